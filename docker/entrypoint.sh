#!/bin/sh
# Container entry point: `coordinator`, `worker`, `healthcheck`, or any other command (run as is).
#
# coordinator: as root, make the certificates folder $GEOLOCO_CERTS and hand it to
#   `geoloco`; as `geoloco`, fill it with `geoloco certs` (the run's CA, a coordinator
#   certificate for $GEOLOCO_SANS, a token file; what is already there is kept, so an
#   operator's own files win), copy ca.pem and the token (never a key) to
#   $GEOLOCO_WORKER_CERTS when set, then serve TLS on $GEOLOCO_LISTEN and write the run to
#   $GEOLOCO_RUN_DIR.
# worker: as root, join the coordinator over TLS (checked against $GEOLOCO_CERTS/ca.pem),
#   which assigns the worker id and with it the worker's WAN and straggler profiles; shape
#   eth0 with tc to that WAN profile (netem where the kernel has it, otherwise rate only,
#   and the worker emulates delay and jitter in process); then drop to the unprivileged
#   user `geoloco` and run the worker, which reclaims the same id from the identity file.
# healthcheck: the gRPC health check of the coordinator in this container, over TLS.
#
# The token is never put on a command line (ps shows those to every user): it comes from
# $GEOLOCO_TOKEN when set, else from the token file in $GEOLOCO_CERTS.
#
# Environment (defaults in brackets):
#   GEOLOCO_COORDINATOR [coordinator:50051]   GEOLOCO_TOKEN [unset: $GEOLOCO_CERTS/token]
#   GEOLOCO_CERTS [/certs]   GEOLOCO_SANS [coordinator,localhost,127.0.0.1]
#   GEOLOCO_WORKER_CERTS [unset]: the coordinator copies ca.pem and token (no key) there,
#     for a volume the workers mount in place of $GEOLOCO_CERTS
#   GEOLOCO_TLS [1; 0 serves and dials plaintext, with --insecure]   GEOLOCO_HEALTH_NAME [localhost]
#   GEOLOCO_TLS_CERT, GEOLOCO_TLS_KEY: a worker's client certificate (mutual TLS, when the
#     coordinator is given GEOLOCO_MTLS=1 and so requires certificates signed by the CA)
#   GEOLOCO_CONFIG [/etc/geoloco/config.toml, used when present]
#   GEOLOCO_LISTEN [0.0.0.0:50051]            GEOLOCO_RUN_DIR [/runs/run]
#   GEOLOCO_IFACE [eth0]   GEOLOCO_RATE_QDISC [tbf|htb]   GEOLOCO_NETEM [auto|yes|no]
#   GEOLOCO_IDENTITY [/run/geoloco/identity.json]   GEOLOCO_SHAPE [1; 0 skips tc]
#   GEOLOCO_WAN_PROFILES, GEOLOCO_STRAGGLER_PROFILES: comma lists by worker id (coordinator)
set -eu

USER_NAME=geoloco
COORDINATOR="${GEOLOCO_COORDINATOR:-coordinator:50051}"
CONFIG="${GEOLOCO_CONFIG:-/etc/geoloco/config.toml}"
IDENTITY="${GEOLOCO_IDENTITY:-/run/geoloco/identity.json}"
CERTS="${GEOLOCO_CERTS:-/certs}"
TLS="${GEOLOCO_TLS:-1}"

log() { echo "entrypoint: $*" >&2; }

# Run "$@" as the unprivileged user, with no capabilities left to regain (as_user: in
# place of this shell; run_as_user: and come back).
as_user() {
    if [ "$(id -u)" != 0 ]; then exec "$@"; fi
    exec setpriv --reuid="$USER_NAME" --regid="$USER_NAME" --init-groups \
        --inh-caps=-all --bounding-set=-all env HOME="/home/$USER_NAME" "$@"
}

run_as_user() {
    if [ "$(id -u)" != 0 ]; then "$@"; return; fi
    setpriv --reuid="$USER_NAME" --regid="$USER_NAME" --init-groups \
        --inh-caps=-all --bounding-set=-all env HOME="/home/$USER_NAME" "$@"
}

config_args() {
    if [ -f "$CONFIG" ]; then echo "--config $CONFIG"; fi
}

# --token-file unless the token comes from the environment
token_args() {
    if [ -z "${GEOLOCO_TOKEN:-}" ]; then echo "--token-file $CERTS/token"; fi
}

# The worker side's TLS flags (the join step and the worker take the same ones).
worker_tls_args() {
    if [ "$TLS" = 0 ]; then echo "--insecure"; return; fi
    echo "--tls-ca $CERTS/ca.pem"
    if [ -n "${GEOLOCO_TLS_CERT:-}" ]; then echo "--tls-cert $GEOLOCO_TLS_CERT --tls-key $GEOLOCO_TLS_KEY"; fi
}

make_certs() {
    if [ "$(id -u)" = 0 ]; then
        mkdir -p "$CERTS" && chown "$USER_NAME:$USER_NAME" "$CERTS"
    fi
    set --
    if [ ! -f "$CERTS/coordinator.pem" ]; then
        for san in $(echo "${GEOLOCO_SANS:-coordinator,localhost,127.0.0.1}" | tr ',' ' '); do
            set -- "$@" --san "$san"
        done
    fi
    run_as_user geoloco certs "$CERTS" "$@" >/dev/null
    publish_for_workers
}

# What the workers may read, into $GEOLOCO_WORKER_CERTS (their own volume): the CA
# certificate and the token, never a key. Written as `geoloco`, through a temp file.
publish_for_workers() {
    out="${GEOLOCO_WORKER_CERTS:-}"
    if [ -z "$out" ]; then return 0; fi
    if [ "$(id -u)" = 0 ]; then
        mkdir -p "$out" && chown "$USER_NAME:$USER_NAME" "$out"
    fi
    # shellcheck disable=SC2016 # expanded by the inner shell
    run_as_user sh -c 'set -eu; umask 077
        for f in ca.pem token; do
            if [ -f "$1/$f" ]; then cp "$1/$f" "$2/.$f.tmp" && mv -f "$2/.$f.tmp" "$2/$f"; fi
        done
        chmod 0644 "$2/ca.pem"' publish "$CERTS" "$out"
}

run_coordinator() {
    run_dir="${GEOLOCO_RUN_DIR:-/runs/run}"
    if [ "$(id -u)" = 0 ]; then
        mkdir -p "$run_dir" && chown "$USER_NAME:$USER_NAME" "$run_dir"
    fi
    make_certs
    # Per-worker lists from the environment (compose) override the config file's.
    if [ -n "${GEOLOCO_WAN_PROFILES:-}" ]; then
        set -- --set "network.per_worker=$GEOLOCO_WAN_PROFILES" "$@"
    fi
    if [ -n "${GEOLOCO_STRAGGLER_PROFILES:-}" ]; then
        set -- --set "stragglers.per_worker=$GEOLOCO_STRAGGLER_PROFILES" "$@"
    fi
    if [ "$TLS" = 0 ]; then
        set -- --insecure "$@"
    else
        set -- --tls-cert "$CERTS/coordinator.pem" --tls-key "$CERTS/coordinator.key" "$@"
        if [ "${GEOLOCO_MTLS:-0}" = 1 ]; then set -- --tls-ca "$CERTS/ca.pem" "$@"; fi
    fi
    # shellcheck disable=SC2046 # config_args and token_args are empty or two words
    as_user geoloco coordinator $(config_args) $(token_args) \
        --listen "${GEOLOCO_LISTEN:-0.0.0.0:50051}" --run-dir "$run_dir" "$@"
}

run_worker() {
    # shellcheck disable=SC2046 # word lists of flags
    if [ "${GEOLOCO_SHAPE:-1}" != 0 ]; then
        if [ "$(id -u)" != 0 ]; then
            log "link shaping needs root (and cap_add NET_ADMIN); set GEOLOCO_SHAPE=0 to skip it"
            exit 3
        fi
        python -m geoloco.worker.container --coordinator "$COORDINATOR" $(token_args) $(worker_tls_args) \
            --identity-file "$IDENTITY" --owner "$USER_NAME" --iface "${GEOLOCO_IFACE:-eth0}" \
            --rate-qdisc "${GEOLOCO_RATE_QDISC:-tbf}" --netem "${GEOLOCO_NETEM:-auto}"
        emulate="$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["emulate"] or "")' "$IDENTITY")"
        set -- --identity-file "$IDENTITY" ${emulate:+--wan-emulate "$emulate"} "$@"
    fi
    # shellcheck disable=SC2046
    as_user geoloco worker --coordinator "$COORDINATOR" $(token_args) $(worker_tls_args) "$@"
}

# Under mutual TLS the check presents the coordinator's certificate (it may also be a client).
run_healthcheck() {
    listen="${GEOLOCO_LISTEN:-0.0.0.0:50051}"
    address="127.0.0.1:${listen##*:}"
    if [ "$TLS" = 0 ]; then exec python -m geoloco.healthcheck "$address"; fi
    set -- --tls-ca "$CERTS/ca.pem" --tls-server-name "${GEOLOCO_HEALTH_NAME:-localhost}"
    if [ "${GEOLOCO_MTLS:-0}" = 1 ]; then
        set -- "$@" --tls-cert "$CERTS/coordinator.pem" --tls-key "$CERTS/coordinator.key"
    fi
    exec python -m geoloco.healthcheck "$address" "$@"
}

role="${1:-worker}"
[ $# -gt 0 ] && shift
case "$role" in
    coordinator) run_coordinator "$@" ;;
    worker) run_worker "$@" ;;
    healthcheck) run_healthcheck ;;
    *) exec "$role" "$@" ;;
esac
