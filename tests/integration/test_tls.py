"""The real coordinator over mutual TLS on a loopback port, probed by clients the project did
not write: `openssl s_client` and the grpcio-health-checking stubs. A client without a
certificate or with one of another CA is refused at the handshake, a wrong token at Join,
and a session replayed over another worker's certificate on every call."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from geoloco import certs, transport
from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc

pytestmark = pytest.mark.slow
TOKEN = "tls-test-token"
RPC_TIMEOUT_S = 30.0
JOIN = "/geoloco.v1.Coordinator/Join"
S_CLIENT_WAIT_S = 10.0  # a refused client sees its connection closed in milliseconds


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[Path, Path]:
    """The run's credentials (3 workers), and a second CA's (1 worker)."""
    root = tmp_path_factory.mktemp("pki")
    certs.make_run_credentials(root / "run", None, 3)
    certs.make_run_credentials(root / "other", None, 1)
    return root / "run", root / "other"


@pytest.fixture(scope="module")
def coordinator(pki, tmp_path_factory) -> Iterator[Coordinator]:
    run = pki[0]
    cfg = load_config(overrides={
        "workers": 3, "rounds": 2, "task.model": "gpt-tiny", "task.seq_len": 16, "task.batch_size": 4,
        "task.val_windows": 4, "task.corpus_bytes": 100_000, "coordinator.listen": "127.0.0.1:0",
        "coordinator.token": TOKEN, "coordinator.join_timeout_s": 600.0, "coordinator.checkpoint_every": 0,
        "tls.cert": str(run / certs.COORDINATOR_CERT), "tls.key": str(run / certs.COORDINATOR_KEY),
        "tls.ca": str(run / certs.CA_CERT)})
    coordinator = Coordinator(cfg, tmp_path_factory.mktemp("tls-run"))
    coordinator.start()
    yield coordinator
    coordinator.stop(grace=0.5)


def channel(port: int, ca: Path, cert_dir: Path | None = None, worker: int = 0) -> grpc.Channel:
    """A TLS channel checked against ``ca``, presenting worker ``worker``'s certificate
    from ``cert_dir`` (none without it)."""
    key = cert = None
    if cert_dir is not None:
        key = (cert_dir / certs.worker_key(worker)).read_bytes()
        cert = (cert_dir / certs.worker_cert(worker)).read_bytes()
    creds = grpc.ssl_channel_credentials(ca.read_bytes(), private_key=key, certificate_chain=cert)
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


def health(ch: grpc.Channel) -> str:
    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def s_client(port: int, ca: Path, cert: Path | None = None, key: Path | None = None,
             wait_s: float = S_CLIENT_WAIT_S) -> str:
    """What `openssl s_client` saw of a TLS 1.3 handshake and the connection after it: the
    server's verdict on a client certificate comes after the client's Finished, as a
    closed connection (`unexpected eof`); an accepted client reads on until its stdin ends
    (`DONE`)."""
    args = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile", str(ca),
            "-verify_return_error", "-alpn", "h2", "-tls1_3"]
    if cert is not None:
        args += ["-cert", str(cert), "-key", str(key)]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:  # a refused client is closed on within this time; an accepted one waits for stdin
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.stdin.close()
        proc.wait(timeout=30)
    return proc.stdout.read().decode(errors="replace")  # h2 frames are binary


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


@needs_openssl
def test_openssl_is_refused_without_a_certificate_or_with_another_cas(coordinator, pki) -> None:
    run, other = pki
    ok = s_client(coordinator.port, run / certs.CA_CERT, run / certs.worker_cert(0), run / certs.worker_key(0),
                  wait_s=2.0)
    assert "Verify return code: 0 (ok)" in ok and "ALPN protocol: h2" in ok, ok
    assert "DONE" in ok and "unexpected eof" not in ok, ok
    none = s_client(coordinator.port, run / certs.CA_CERT)
    foreign = s_client(coordinator.port, run / certs.CA_CERT, other / certs.worker_cert(0),
                       other / certs.worker_key(0))
    for seen in (none, foreign):
        assert "unexpected eof while reading" in seen and "DONE" not in seen, seen


@needs_openssl
def test_openssl_refuses_a_coordinator_of_another_ca(coordinator, pki) -> None:
    run, other = pki
    seen = s_client(coordinator.port, other / certs.CA_CERT, run / certs.worker_cert(0), run / certs.worker_key(0))
    assert "certificate verify failed" in seen or "Verify return code: 2" in seen, seen


def test_health_stubs_over_tls_are_served_only_with_a_certificate_of_the_run(coordinator, pki) -> None:
    run, other = pki
    with channel(coordinator.port, run / certs.CA_CERT, run) as ch:
        assert health(ch) == "SERVING"
    for ch in (channel(coordinator.port, run / certs.CA_CERT),
               channel(coordinator.port, run / certs.CA_CERT, other),
               grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")):
        with ch, pytest.raises(grpc.RpcError) as refused:
            health(ch)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_wrong_token_is_refused_over_tls(coordinator, pki) -> None:
    run, _ = pki
    with channel(coordinator.port, run / certs.CA_CERT, run, worker=2) as ch:
        join = ch.unary_unary(JOIN)  # raw bytes: gRPC's own generic call
        with pytest.raises(grpc.RpcError) as refused:
            join(pb.JoinRequest(token="not-the-token").SerializeToString(), timeout=RPC_TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "wrong token" in refused.value.details()


def test_a_session_replayed_over_another_certificate_is_refused(coordinator, pki) -> None:
    run, _ = pki
    ca = run / certs.CA_CERT
    with channel(coordinator.port, ca, run, worker=0) as mine, channel(coordinator.port, ca, run, worker=1) as theirs:
        victim = geoloco_pb2_grpc.CoordinatorStub(mine).Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=RPC_TIMEOUT_S)
        attacker = geoloco_pb2_grpc.CoordinatorStub(theirs)
        attacker.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=RPC_TIMEOUT_S)  # it holds the token too
        sniffed = {"worker_id": victim.worker_id, "session": victim.session}
        metadata = transport.caller_metadata(victim.worker_id, victim.session)
        calls = {
            "FetchState": lambda: list(attacker.FetchState(pb.FetchStateRequest(**sniffed), timeout=RPC_TIMEOUT_S)),
            "Rounds": lambda: next(iter(attacker.Rounds(pb.RoundsRequest(**sniffed), timeout=RPC_TIMEOUT_S))),
            "Push": lambda: attacker.Push(iter([pb.PushChunk(header=pb.PushHeader(round=0, total_bytes=10, **sniffed))]),
                                          metadata=metadata, timeout=RPC_TIMEOUT_S),
            "reclaim": lambda: attacker.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION, reclaim_worker_id=victim.worker_id,
                                                            reclaim_session=victim.session), timeout=RPC_TIMEOUT_S),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "another certificate" in refused.value.details(), name
        # the victim itself, over its own certificate, is still served
        state = list(geoloco_pb2_grpc.CoordinatorStub(mine).FetchState(
            pb.FetchStateRequest(**sniffed), timeout=RPC_TIMEOUT_S))
        assert state and state[0].total_bytes > 0
