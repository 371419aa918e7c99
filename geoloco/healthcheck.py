"""Container health probe through the standard gRPC health service (grpc.health.v1):
``python -m geoloco.healthcheck HOST:PORT [SERVICE]`` exits 0 when the server says SERVING.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2
TIMEOUT_S = 3.0


def check(address: str, service: str = "", timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """Ask ``address`` for the health of ``service`` ("" = the whole server).
    Returns (serving, what was seen)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m geoloco.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return EXIT_USAGE
    serving, seen = check(args[0], args[1] if len(args) > 1 else "")
    print(f"{args[0]}: {seen}")
    return EXIT_HEALTHY if serving else EXIT_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
