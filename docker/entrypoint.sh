#!/bin/sh
# Container entry point: `coordinator`, `worker`, or any other command (run as is).
#
# worker: as root, join the coordinator, which assigns the worker id and with it the
#   worker's WAN and straggler profiles; shape eth0 with tc to that WAN profile (netem
#   where the kernel has it, otherwise rate only, and the worker emulates delay and jitter
#   in process); then drop to the unprivileged user `geoloco` and run the worker, which
#   reclaims the same id from the identity file.
# coordinator: as `geoloco`, serve on $GEOLOCO_LISTEN and write the run to $GEOLOCO_RUN_DIR.
#
# Environment (defaults in brackets):
#   GEOLOCO_COORDINATOR [coordinator:50051]   GEOLOCO_TOKEN [geoloco]
#   GEOLOCO_CONFIG [/etc/geoloco/config.toml, used when present]
#   GEOLOCO_LISTEN [0.0.0.0:50051]            GEOLOCO_RUN_DIR [/runs/run]
#   GEOLOCO_IFACE [eth0]   GEOLOCO_RATE_QDISC [tbf|htb]   GEOLOCO_NETEM [auto|yes|no]
#   GEOLOCO_IDENTITY [/run/geoloco/identity.json]   GEOLOCO_SHAPE [1; 0 skips tc]
#   GEOLOCO_WAN_PROFILES, GEOLOCO_STRAGGLER_PROFILES: comma lists by worker id (coordinator)
set -eu

USER_NAME=geoloco
COORDINATOR="${GEOLOCO_COORDINATOR:-coordinator:50051}"
TOKEN="${GEOLOCO_TOKEN:-geoloco}"
CONFIG="${GEOLOCO_CONFIG:-/etc/geoloco/config.toml}"
IDENTITY="${GEOLOCO_IDENTITY:-/run/geoloco/identity.json}"

log() { echo "entrypoint: $*" >&2; }

# Run "$@" as the unprivileged user, with no capabilities left to regain.
as_user() {
    if [ "$(id -u)" != 0 ]; then exec "$@"; fi
    exec setpriv --reuid="$USER_NAME" --regid="$USER_NAME" --init-groups \
        --inh-caps=-all --bounding-set=-all env HOME="/home/$USER_NAME" "$@"
}

config_args() {
    if [ -f "$CONFIG" ]; then echo "--config $CONFIG"; fi
}

run_coordinator() {
    run_dir="${GEOLOCO_RUN_DIR:-/runs/run}"
    if [ "$(id -u)" = 0 ]; then
        mkdir -p "$run_dir" && chown "$USER_NAME:$USER_NAME" "$run_dir"
    fi
    # Per-worker lists from the environment (compose) override the config file's.
    if [ -n "${GEOLOCO_WAN_PROFILES:-}" ]; then
        set -- --set "network.per_worker=$GEOLOCO_WAN_PROFILES" "$@"
    fi
    if [ -n "${GEOLOCO_STRAGGLER_PROFILES:-}" ]; then
        set -- --set "stragglers.per_worker=$GEOLOCO_STRAGGLER_PROFILES" "$@"
    fi
    # shellcheck disable=SC2046 # config_args is empty or two words
    as_user geoloco coordinator $(config_args) --listen "${GEOLOCO_LISTEN:-0.0.0.0:50051}" \
        --run-dir "$run_dir" --token "$TOKEN" "$@"
}

run_worker() {
    if [ "${GEOLOCO_SHAPE:-1}" != 0 ]; then
        if [ "$(id -u)" != 0 ]; then
            log "link shaping needs root (and cap_add NET_ADMIN); set GEOLOCO_SHAPE=0 to skip it"
            exit 3
        fi
        python -m geoloco.worker.container --coordinator "$COORDINATOR" --token "$TOKEN" \
            --identity-file "$IDENTITY" --owner "$USER_NAME" --iface "${GEOLOCO_IFACE:-eth0}" \
            --rate-qdisc "${GEOLOCO_RATE_QDISC:-tbf}" --netem "${GEOLOCO_NETEM:-auto}"
        emulate="$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["emulate"] or "")' "$IDENTITY")"
        set -- --identity-file "$IDENTITY" ${emulate:+--wan-emulate "$emulate"} "$@"
    fi
    as_user geoloco worker --coordinator "$COORDINATOR" --token "$TOKEN" "$@"
}

role="${1:-worker}"
[ $# -gt 0 ] && shift
case "$role" in
    coordinator) run_coordinator "$@" ;;
    worker) run_worker "$@" ;;
    *) exec "$role" "$@" ;;
esac
