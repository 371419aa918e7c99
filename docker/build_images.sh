#!/usr/bin/env bash
# `make images`: build geoloco:latest with no image registry and no package index needed.
#   1. the base image: $GEOLOCO_BASE_IMAGE if set; else python:3.11-slim when it is already
#      present; else geoloco-base:bookworm, built offline by build_base_image.sh if missing;
#   2. the wheelhouse of dependencies (build_wheelhouse.sh; skipped when up to date);
#   3. docker build, dependencies first and the project last (a code change: seconds).
# Prints how long each step took.  GEOLOCO_IMAGE names the result (default geoloco:latest).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"
IMAGE="${GEOLOCO_IMAGE:-geoloco:latest}"
# The legacy builder is what the Docker SDK drives as well, so both share one layer cache
# (and it works with any engine; BuildKit needs buildx with newer clients).
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"

log() { echo "build_images: $*" >&2; }
timed() { local start=$SECONDS; "$@"; log "$(basename "$1") took $(( SECONDS - start )) s"; }

docker info >/dev/null 2>&1 || { log "no Docker engine answers (start dockerd)"; exit 1; }

base="${GEOLOCO_BASE_IMAGE:-}"
if [[ -z "$base" ]]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1; then
        base=python:3.11-slim
    else
        base=geoloco-base:bookworm
        GEOLOCO_BASE_IMAGE="$base" timed "$HERE/build_base_image.sh"
    fi
fi
timed "$HERE/build_wheelhouse.sh"
start=$SECONDS
docker build --quiet -f "$HERE/Dockerfile" --build-arg BASE_IMAGE="$base" -t "$IMAGE" "$ROOT" >/dev/null
log "docker build $IMAGE (base $base) took $(( SECONDS - start )) s;" \
    "$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
