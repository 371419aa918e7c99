"""The container health probe (geoloco.healthcheck) against a real gRPC health service."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from geoloco import healthcheck


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_serving_server_is_healthy(health_server, capsys) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address]) == healthcheck.EXIT_HEALTHY
    assert "SERVING" in capsys.readouterr().out


def test_not_serving_server_is_unhealthy(health_server, capsys) -> None:
    address, servicer = health_server
    servicer.set("geoloco.v1.Coordinator", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([address, "geoloco.v1.Coordinator"]) == healthcheck.EXIT_UNHEALTHY
    assert "NOT_SERVING" in capsys.readouterr().out


def test_nothing_listening_is_unhealthy() -> None:
    serving, seen = healthcheck.check("127.0.0.1:1", timeout_s=1.0)
    assert not serving and "UNAVAILABLE" in seen


def test_usage_error() -> None:
    assert healthcheck.main([]) == healthcheck.EXIT_USAGE
