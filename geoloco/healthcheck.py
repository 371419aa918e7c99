"""Container health probe through the standard gRPC health service (grpc.health.v1):
``python -m geoloco.healthcheck HOST:PORT [SERVICE] [--tls-ca PEM ...]`` exits 0 when the
server says SERVING; over TLS with ``--tls-ca`` (and a client certificate under mutual TLS).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2
TIMEOUT_S = 3.0


def check(address: str, service: str = "", timeout_s: float = TIMEOUT_S,
          security=None) -> tuple[bool, str]:
    """Ask ``address`` for the health of ``service`` ("" = the whole server), over TLS
    with ``security`` (a geoloco.transport.ChannelSecurity). Returns (serving, what was seen)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from geoloco.transport import open_channel

    with open_channel(address, security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m geoloco.healthcheck",
                                description="Exit 0 when the gRPC health service says SERVING.")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("service", nargs="?", default="")
    p.add_argument("--tls-ca", metavar="PEM", help="check the server's certificate with this CA")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", metavar="PEM", help="its private key")
    p.add_argument("--tls-server-name", metavar="NAME", help="name the server's certificate carries")
    try:
        args = p.parse_args(argv)
    except SystemExit:
        return EXIT_USAGE
    security = None
    if args.tls_ca or args.tls_cert:
        from geoloco.config import ConfigError, TlsConfig
        from geoloco.tls import channel_security

        try:
            security = channel_security(TlsConfig(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
                                                  server_name=args.tls_server_name), args.address)
        except ConfigError as exc:
            print(f"{args.address}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    serving, seen = check(args.address, args.service, security=security)
    print(f"{args.address}: {seen}")
    return EXIT_HEALTHY if serving else EXIT_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
