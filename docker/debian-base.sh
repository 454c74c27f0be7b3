#!/usr/bin/env bash
# A base image for docker/Dockerfile built from Debian's own packages, for machines that reach
# Debian's mirror but no image registry: Debian bookworm (minbase) with Python 3.11, its venv
# module and bubblewrap (the trainers' sandbox, workers/sandbox.py), imported into podman as
# $BASE_TAG (default localhost/shardyard-base:bookworm).
#   docker/debian-base.sh && BASE_IMAGE=localhost/shardyard-base:bookworm make image
# Kept when it exists already (remove the image to rebuild it); the tarball is cached in
# $BASE_CACHE (default /var/tmp/shardyard-base), so a removed image is re-imported in seconds.
set -euo pipefail

TAG=${BASE_TAG:-localhost/shardyard-base:bookworm}
CACHE=${BASE_CACHE:-/var/tmp/shardyard-base}
PODMAN=(podman --runtime "${PODMAN_RUNTIME:-runc}")

if "${PODMAN[@]}" image exists "$TAG"; then
  echo "base image $TAG: present"
  exit 0
fi
mkdir -p "$CACHE"
tar="$CACHE/bookworm-python3-bwrap.tar"
# a directory under the tarball's name: left by an earlier version of this script, which let
# mmdebstrap guess the format
[ -f "$tar" ] || rm -rf "$tar"
if [ ! -s "$tar" ]; then
  command -v mmdebstrap >/dev/null || {
    echo "mmdebstrap not found: apt-get install mmdebstrap" >&2
    exit 1
  }
  # written beside, then renamed: an interrupted run leaves no half tarball to import later
  # --format: the name ends in .part, from which mmdebstrap would guess a directory
  mmdebstrap --variant=minbase --format=tar --include=python3,python3-venv,ca-certificates,bubblewrap \
    bookworm "$tar.part"
  mv "$tar.part" "$tar"
fi
"${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' "$tar" "$TAG"
echo "base image $TAG: imported from $tar"
