#!/usr/bin/env bash
# Fill docker/.build/wheelhouse with binary wheels of the project's runtime dependencies
# (from pyproject.toml, pinned by constraints.txt) plus the build backend, for CPython 3.11
# on x86_64 Linux, so `docker build` installs everything with no network in the container.
# Uses the host's pip configuration (index, find-links: the local CPU torch wheel here).
#
# Usage: docker/build_wheelhouse.sh [--force]      (PYTHON=... picks the host interpreter)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/docker/.build/wheelhouse"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3
STAMP="$OUT/.inputs"

log() { echo "build_wheelhouse: $*" >&2; }

# The runtime requirements, read from pyproject.toml, plus setuptools for the offline
# build of the project itself inside the image.
REQS="$("$PYTHON" - "$ROOT/pyproject.toml" <<'EOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
reqs = list(project["project"]["dependencies"]) + list(project["build-system"]["requires"])
print("\n".join(reqs))
EOF
)"

inputs="$(printf '%s\n' "$REQS"; cat "$ROOT/constraints.txt")"
if [[ "${1:-}" != "--force" && -f "$STAMP" && "$(cat "$STAMP")" == "$inputs" ]]; then
    log "$OUT is up to date ($(du -sh "$OUT" | cut -f1)); --force rebuilds it"
    exit 0
fi

rm -rf "$OUT" && mkdir -p "$OUT"
start=$(date +%s)
mapfile -t req_args <<<"$REQS"
# Binary wheels for the image's interpreter (CPython 3.11, Debian bookworm: glibc 2.36),
# whatever the host's Python is; environment markers are evaluated for that target.
"$PYTHON" -m pip download --quiet --dest "$OUT" --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 \
    -c "$ROOT/constraints.txt" "${req_args[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
printf '%s\n' "$inputs" > "$STAMP"
log "$(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1), in $(( $(date +%s) - start )) s"
