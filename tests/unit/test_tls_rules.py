"""geoloco.tls: when plaintext is allowed (loopback, or --insecure with a warning at every
start), what a worker's channel checks, and the health probe over TLS against a real
gRPC server with certificates from geoloco.certs."""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from geoloco import certs, healthcheck
from geoloco.config import ConfigError, TlsConfig
from geoloco.tls import channel_security, is_loopback, server_credentials


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pki") / "certs"
    certs.make_run_credentials(out, None, 1)
    return out


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.10", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "coord.example.org"))


def test_plaintext_only_on_loopback_or_insecure_with_a_warning_at_every_start(caplog) -> None:
    assert server_credentials(TlsConfig(), "127.0.0.1:0") is None
    with pytest.raises(ConfigError, match="not a loopback address and no TLS"):
        server_credentials(TlsConfig(), "0.0.0.0:50051")
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="geoloco.tls"):
            caplog.clear()
            assert server_credentials(TlsConfig(insecure=True), "0.0.0.0:50051") is None
        assert "INSECURE: the coordinator serves PLAINTEXT on 0.0.0.0:50051" in caplog.text


def test_a_worker_uses_tls_off_loopback_even_without_a_ca(caplog, pki: Path) -> None:
    assert channel_security(TlsConfig(), "127.0.0.1:50051") is None
    with caplog.at_level(logging.INFO, logger="geoloco.tls"):
        assert channel_security(TlsConfig(), "coord.example.org:50051") is not None
    assert "system's root certificates" in caplog.text
    assert channel_security(TlsConfig(insecure=True), "coord.example.org:50051") is None
    mine = channel_security(TlsConfig(ca=str(pki / certs.CA_CERT), server_name="coordinator"), "127.0.0.1:1")
    assert mine is not None and mine.server_name == "coordinator"
    with pytest.raises(ConfigError, match="tls.ca: cannot read"):
        channel_security(TlsConfig(ca=str(pki / "absent.pem")), "127.0.0.1:1")
    with pytest.raises(ConfigError, match="is not a PEM file"):
        server_credentials(TlsConfig(cert=str(pki / certs.TOKEN_FILE), key=str(pki / certs.TOKEN_FILE)), "127.0.0.1:0")


def test_the_health_probe_over_tls(pki: Path, capsys) -> None:
    tls = TlsConfig(cert=str(pki / certs.COORDINATOR_CERT), key=str(pki / certs.COORDINATOR_KEY))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls, "127.0.0.1:0"))
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        assert healthcheck.main([address, "--tls-ca", str(pki / certs.CA_CERT)]) == healthcheck.EXIT_HEALTHY
        assert "SERVING" in capsys.readouterr().out
        assert healthcheck.main([address]) == healthcheck.EXIT_UNHEALTHY  # plaintext to a TLS port
    finally:
        server.stop(0)
