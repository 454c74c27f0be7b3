#!/bin/sh
# redis-server with the compose deployment's users (docker/redis/users.acl.in): the template's
# password marks are filled in from the environment, into a file only redis reads, and the
# server starts with it (the passwords never appear on a command line). Extra arguments go to
# redis-server. The passwords must be hex (`openssl rand -hex 32`): they are pasted in as they are.
set -eu
template=${SHARDYARD_REDIS_ACL_TEMPLATE:-/etc/shardyard/users.acl.in}
acl=${SHARDYARD_REDIS_ACL_FILE:-/data/users.acl}
for name in OPS API SCHEDULER WORKER; do
    eval "value=\${SHARDYARD_REDIS_${name}_PASSWORD:-}"
    case $value in
        "" | *[!0-9a-fA-F]*)
            echo "SHARDYARD_REDIS_${name}_PASSWORD: set it to hex digits (openssl rand -hex 32)" >&2
            exit 1
            ;;
    esac
done
umask 077
sed -e "s/@OPS_PASSWORD@/$SHARDYARD_REDIS_OPS_PASSWORD/" \
    -e "s/@API_PASSWORD@/$SHARDYARD_REDIS_API_PASSWORD/" \
    -e "s/@SCHEDULER_PASSWORD@/$SHARDYARD_REDIS_SCHEDULER_PASSWORD/" \
    -e "s/@WORKER_PASSWORD@/$SHARDYARD_REDIS_WORKER_PASSWORD/" \
    -e '/^#/d' -e '/^$/d' \
    "$template" >"$acl"
# the redis image starts this as root: the server itself runs as the image's redis user
# (SHARDYARD_REDIS_RUN_AS; empty: as whoever runs this)
user=${SHARDYARD_REDIS_RUN_AS-redis}
if [ -n "$user" ] && [ "$(id -u)" = 0 ]; then
    chown "$user" "$acl"
    if command -v gosu >/dev/null; then
        exec gosu "$user" redis-server --aclfile "$acl" "$@"
    fi
    exec setpriv --reuid="$user" --regid="$user" --init-groups redis-server --aclfile "$acl" "$@"
fi
exec redis-server --aclfile "$acl" "$@"
