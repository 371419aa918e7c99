#!/usr/bin/env bash
# Build the offline base image geoloco-base:bookworm: a minimal Debian bookworm root
# filesystem (debootstrap, minbase) with python3, python3-venv and iproute2, imported
# with `docker import`. For machines that reach a Debian mirror but no image registry;
# everyone else keeps the Dockerfile's default base, python:3.11-slim.
#
# Usage: docker/build_base_image.sh [--force]
#   GEOLOCO_BASE_IMAGE  image name to create (default geoloco-base:bookworm)
#   DEBIAN_MIRROR       mirror URL (default: the first bookworm mirror in /etc/apt/sources.list*)
set -euo pipefail

IMAGE="${GEOLOCO_BASE_IMAGE:-geoloco-base:bookworm}"
SUITE=bookworm
PACKAGES=python3,python3-venv,iproute2,ca-certificates,procps
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

log() { echo "build_base_image: $*" >&2; }

if [[ $FORCE == 0 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE exists; skipping (--force rebuilds it)"
    exit 0
fi

# The machine's own Debian mirror: one-line sources (`deb URL bookworm main`) or deb822
# sources (`URIs: URL` with `Suites: bookworm ...`). Security and backports mirrors are
# skipped: debootstrap needs the main archive.
find_mirror() {
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
    local f
    for f in "${files[@]}"; do
        [[ -f "$f" ]] || continue
        awk -v suite="$SUITE" '
            /^[[:space:]]*deb[[:space:]]/ {
                i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite && $i !~ /security/) { print $i; exit }
            }
            /^[[:space:]]*$/ { if (uri != "" && hit) { print uri; exit } uri = ""; hit = 0 }
            /^URIs:/ { uri = $2 }
            /^Suites:/ { for (j = 2; j <= NF; j++) if ($j == suite) hit = 1 }
            END { if (uri != "" && hit && uri !~ /security/) print uri }
        ' "$f" | grep -v security | head -n 1
    done | head -n 1
}

MIRROR="${DEBIAN_MIRROR:-$(find_mirror)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
command -v debootstrap >/dev/null || { log "debootstrap is missing: apt-get install -y debootstrap"; exit 1; }
[[ $(id -u) == 0 ]] || { log "debootstrap needs root"; exit 1; }

ROOTFS="$(mktemp -d /tmp/geoloco-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
log "debootstrap $SUITE (minbase: $PACKAGES) from $MIRROR"
start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >&2
# Trim what a container never needs: package lists, caches, docs and man pages.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
    "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
log "debootstrap took $(( $(date +%s) - start )) s"

tar -C "$ROOTFS" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap $SUITE minbase + $PACKAGES" - "$IMAGE" >/dev/null
log "imported $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
