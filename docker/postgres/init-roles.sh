#!/bin/sh
# The login roles of the compose deployment, made once when the postgres container initialises its
# volume (the image runs /docker-entrypoint-initdb.d/*.sh as POSTGRES_USER, the owner of the
# database and its schema, who runs the migrations). What each role may do on the tables is
# docker/postgres/grants.sql, applied by the `migrate` service after every migration (new tables
# come with new versions). docs/security.md, "The broker", says why.
set -eu
for name in API SCHEDULER WORKER; do
    eval "value=\${SHARDYARD_DB_${name}_PASSWORD:-}"
    if [ -z "$value" ]; then
        echo "SHARDYARD_DB_${name}_PASSWORD is not set" >&2
        exit 1
    fi
done
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    -v api_password="$SHARDYARD_DB_API_PASSWORD" \
    -v scheduler_password="$SHARDYARD_DB_SCHEDULER_PASSWORD" \
    -v worker_password="$SHARDYARD_DB_WORKER_PASSWORD" \
    -v db="$POSTGRES_DB" <<'SQL'
CREATE ROLE shardyard_api LOGIN PASSWORD :'api_password';
CREATE ROLE shardyard_scheduler LOGIN PASSWORD :'scheduler_password';
CREATE ROLE shardyard_worker LOGIN PASSWORD :'worker_password';
-- only these roles (and the owner) reach this database; none may create anything in it
REVOKE ALL ON DATABASE :"db" FROM PUBLIC;
GRANT CONNECT ON DATABASE :"db" TO shardyard_api, shardyard_scheduler, shardyard_worker;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
SQL
