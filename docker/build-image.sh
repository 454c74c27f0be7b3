#!/usr/bin/env bash
# Build docker/Dockerfile as $SHARDYARD_IMAGE (default shardyard:latest) with docker, when a docker
# daemon answers, else podman. `make image` runs this.
#
# Settings (environment):
#   SHARDYARD_IMAGE   the tag to build
#   BASE_IMAGE        passed on as the build argument (default: the Dockerfile's python:3.11-slim)
#   TORCH_INDEX_URL   passed on (default: the Dockerfile's CPU index); a CUDA build:
#                     TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 make image
#   WHEELS            a folder of wheels for pip (default: pip's configured find-links); when it
#                     holds torch's CPU wheel, that wheel is installed and no torch index is asked
#   CA_BUNDLE         a CA bundle for pip and npm inside the build (default: pip's configured
#                     `cert`), for machines whose TLS goes through an inspecting proxy
# The wheels and the CA bundle are build-time mounts: neither ends up in the image.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${SHARDYARD_IMAGE:-shardyard:latest}
PIP=${PIP:-$(command -v pip3 || command -v pip || true)}

# a setting of pip's (its environment variable, else its config files), e.g. `pip_config cert`
pip_config() {
  local var="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!var:-}" ]; then
    echo "${!var}"
  elif [ -n "$PIP" ]; then
    "$PIP" config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | head -n1 || true
  fi
}

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  build=(docker build)
elif command -v podman >/dev/null; then
  # runc: crun cannot set up the cgroups of some hosts; explicit rlimits below the hard limits
  # this shell has: podman's defaults (the host's own values) are refused where podman itself
  # runs inside a limited container. `--format docker` keeps the HEALTHCHECK, which the OCI
  # image format has no field for.
  nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] || [ "$nofile" -gt 8192 ] && nofile=8192
  build=(podman --runtime "${PODMAN_RUNTIME:-runc}" build --format docker
    --ulimit "nofile=$nofile:$nofile" --ulimit nproc=1024:1024)
else
  echo "make image: neither a running docker daemon (docker info) nor podman found" >&2
  exit 1
fi

args=(--network host -f docker/Dockerfile -t "$IMAGE")
[ -n "${BASE_IMAGE:-}" ] && args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")

wheels=${WHEELS:-$(pip_config find-links)}
wheels=${wheels%% *}
if [ -n "$wheels" ] && [ -d "$wheels" ]; then
  args+=(--build-context "wheels=$wheels")
  if [ -z "${TORCH_INDEX_URL+set}" ] && compgen -G "$wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
    args+=(--build-arg TORCH_INDEX_URL= --build-arg TORCH_VERSION=2.13.0+cpu)
  fi
fi
[ -n "${TORCH_INDEX_URL+set}" ] && args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")

ca=${CA_BUNDLE:-$(pip_config cert)}
[ -n "$ca" ] && [ -f "$ca" ] && args+=(--secret "id=cacert,src=$ca")

echo "+ ${build[*]} ${args[*]} ." >&2
exec "${build[@]}" "${args[@]}" .
