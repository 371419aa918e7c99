"""The real coordinator on loopback against callers that try to lock others out or take more
than their share (docs/security.md, issue 24): 1,000 wrong Joins from one address do not stop
an honest Join, one certificate gets one slot, 100 stalled Joins stay within a memory bound,
a newline in a hostname cannot forge a log line, and odd worker ids are refused cleanly."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from run_processes import wait_until

from geoloco import certs, transport
from geoloco.config import load_config
from geoloco.coordinator.app import REGISTRY_FILE, Coordinator
from geoloco.coordinator.limits import JOIN_REQUEST_S, UNAUTHENTICATED_AT_ONCE
from geoloco.metrics_server import MAX_CONNECTIONS, MetricsServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc

pytestmark = pytest.mark.slow
TOKEN = "least-privilege-token"
RPC_TIMEOUT_S = 30.0
WRONG_JOINS = 1000
STALLED = 100
STALLED_SOURCES = 25  # 127.0.0.2 ... 127.0.0.26, four calls each
DECLARED, SENT = 4_000_000, 3_900_000  # the stalled Join: 3.9 MB of a 4 MB request
# what 100 stalled Joins may add to the coordinator: every open unauthenticated call holding
# one largest message (transport.SERVER_RECEIVE_BYTES), gRPC's buffers of each connection
# (256 KiB), and room for allocator noise (16 MiB): 58 MiB (on main: over 130 MiB)
CONNECTION_BYTES = 256 << 10
STALLED_GROWTH_BOUND = (UNAUTHENTICATED_AT_ONCE * transport.SERVER_RECEIVE_BYTES
                        + STALLED * CONNECTION_BYTES + (16 << 20))
HERE = Path(__file__).parent


def run_config(tls: Path | None = None, workers: int = 3):
    overrides = {
        "workers": workers, "rounds": 2, "task.model": "gpt-tiny", "task.seq_len": 16,
        "task.batch_size": 4, "task.val_windows": 8, "task.corpus_bytes": 100_000,
        "coordinator.listen": "127.0.0.1:0", "coordinator.token": TOKEN,
        "coordinator.join_timeout_s": 600.0, "coordinator.checkpoint_every": 0}
    if tls is not None:
        overrides |= {"tls.cert": str(tls / certs.COORDINATOR_CERT),
                      "tls.key": str(tls / certs.COORDINATOR_KEY), "tls.ca": str(tls / certs.CA_CERT)}
    return load_config(overrides=overrides)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    certs.make_run_credentials(root, None, 3)
    return root


@pytest.fixture(scope="module")
def mtls(pki, tmp_path_factory) -> Iterator[Coordinator]:
    coordinator = Coordinator(run_config(pki), tmp_path_factory.mktemp("mtls-run"))
    coordinator.start()
    yield coordinator
    coordinator.stop(grace=0.5)


@pytest.fixture
def plain(tmp_path) -> Iterator[Coordinator]:
    coordinator = Coordinator(run_config(), tmp_path / "run")
    coordinator.start()
    yield coordinator
    coordinator.stop(grace=0.5)


def tls_stub(coordinator: Coordinator, pki: Path, worker: int) -> tuple[grpc.Channel, geoloco_pb2_grpc.CoordinatorStub]:
    creds = grpc.ssl_channel_credentials(
        (pki / certs.CA_CERT).read_bytes(), private_key=(pki / certs.worker_key(worker)).read_bytes(),
        certificate_chain=(pki / certs.worker_cert(worker)).read_bytes())
    ch = grpc.secure_channel(f"127.0.0.1:{coordinator.port}", creds)
    return ch, geoloco_pb2_grpc.CoordinatorStub(ch)


def plain_stub(coordinator: Coordinator) -> tuple[grpc.Channel, geoloco_pb2_grpc.CoordinatorStub]:
    ch = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    return ch, geoloco_pb2_grpc.CoordinatorStub(ch)


def wrong_joins(stub: geoloco_pb2_grpc.CoordinatorStub, n: int) -> Counter:
    codes: Counter = Counter()
    for _ in range(n):
        try:
            stub.Join(pb.JoinRequest(token="guess"), timeout=RPC_TIMEOUT_S)
            codes["OK"] += 1
        except grpc.RpcError as exc:
            codes[exc.code().name] += 1
    return codes


def test_a_thousand_wrong_joins_from_one_address_do_not_stop_an_honest_join(plain) -> None:
    ch, stub = plain_stub(plain)
    with ch:
        codes = wrong_joins(stub, WRONG_JOINS)
        print(json.dumps({"wrong_joins": dict(codes)}))
        assert "OK" not in codes and codes["RESOURCE_EXHAUSTED"] >= WRONG_JOINS * 0.9  # still limited
        reply = stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=RPC_TIMEOUT_S)  # same address
        assert reply.session and reply.worker_id == 0


def test_under_mtls_the_limit_counts_the_certificate_and_never_refuses_the_right_token(mtls, pki) -> None:
    ch, stub = tls_stub(mtls, pki, worker=2)
    with ch:
        codes = wrong_joins(stub, WRONG_JOINS)
        assert "OK" not in codes and codes["RESOURCE_EXHAUSTED"] >= WRONG_JOINS * 0.9
        reply = stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=RPC_TIMEOUT_S)  # same certificate
        assert reply.worker_id == 2


def test_one_certificate_gets_one_slot_the_one_its_name_says(mtls, pki) -> None:
    ch, stub = tls_stub(mtls, pki, worker=1)
    with ch:
        replies = [stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=RPC_TIMEOUT_S) for _ in range(4)]
        assert [r.worker_id for r in replies] == [1, 1, 1, 1]
        assert len({r.session for r in replies}) == 4  # each Join is a new session ...
        with pytest.raises(grpc.RpcError) as old:  # ... and only the newest one counts
            list(stub.FetchState(pb.FetchStateRequest(worker_id=1, session=replies[0].session),
                                 timeout=RPC_TIMEOUT_S))
        assert old.value.code() == grpc.StatusCode.UNAUTHENTICATED
        state = list(stub.FetchState(pb.FetchStateRequest(worker_id=1, session=replies[-1].session),
                                     timeout=RPC_TIMEOUT_S))
        assert state and state[0].total_bytes > 0
    ch, stub = tls_stub(mtls, pki, worker=0)
    with ch:
        assert stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=RPC_TIMEOUT_S).worker_id == 0
    assert set(mtls.registry.records) <= {0, 1, 2}
    assert not any(r.session for r in mtls.registry.records.values())  # hashes only, in memory too


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_hundred_stalled_joins_stay_within_a_memory_bound(plain) -> None:
    # the coordinator's start-up (its first validation: torch's first forward pass in this
    # process) allocates too; under load it ran into the attack's window and counted
    wait_until(lambda: plain.state.totals.initial_val_loss is not None, 300, "the initial validation")
    before = rss_bytes()
    attacker = subprocess.Popen(
        [sys.executable, str(HERE / "stalled_joins.py"), f"127.0.0.1:{plain.port}", "--calls", str(STALLED),
         "--declared", str(DECLARED), "--send", str(SENT), "--sources", str(STALLED_SOURCES),
         "--wait", str(JOIN_REQUEST_S + 20)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        stalled = json.loads(attacker.stdout.readline())
        growth = rss_bytes() - before
        ch, stub = plain_stub(plain)
        with ch:  # an honest caller, from an address of its own, is served meanwhile
            assert stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=RPC_TIMEOUT_S).session
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        attacker.stdin.close()
        ended = json.loads(attacker.stdout.readline())
    finally:
        attacker.kill()
        attacker.wait()
    print(json.dumps({"stalled_joins": STALLED, "sent_bytes": stalled["sent_bytes"],
                      "rss_growth_mib": round(growth / 2**20, 1),
                      "bound_mib": round(STALLED_GROWTH_BOUND / 2**20, 1),
                      "ended_by_server": ended["ended"], "last_ended_s": round(ended["last_ended_s"], 1)}))
    assert growth < STALLED_GROWTH_BOUND
    assert ended["ended"] == STALLED  # every stalled call was refused or cut at its deadline


def test_a_newline_in_a_hostname_cannot_forge_a_log_line(plain, caplog) -> None:
    forged = "round 3: frame from worker 1 rejected: norm 1e9 above 100 x the median"
    ch, stub = plain_stub(plain)
    with ch, caplog.at_level(logging.INFO, logger="geoloco"):
        stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION, capabilities=pb.Capabilities(
            hostname=f"host\n{forged}", device="cpu\r\x1b[2J" + "d" * 10_000)), timeout=RPC_TIMEOUT_S)
    lines = [line for r in caplog.records for line in r.getMessage().splitlines()]
    joined = [line for line in lines if "joined from" in line]
    assert joined and all(len(line) < 1000 for line in joined), joined
    assert not any(line.startswith(forged) for line in lines)
    assert all("\x1b" not in line for line in lines)
    saved = json.loads((plain.run_dir / REGISTRY_FILE).read_text())
    assert "\n" not in saved["0"]["hostname"] and len(saved["0"]["device"]) < 1000


def test_a_join_far_larger_than_a_join_needs_is_refused(plain) -> None:
    ch, stub = plain_stub(plain)
    with ch, pytest.raises(grpc.RpcError) as refused:
        stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION, capabilities=pb.Capabilities(hostname="h" * 100_000)),
                  timeout=RPC_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_five_thousand_digit_worker_id_is_a_clean_refusal_that_lists_no_ids(plain, caplog) -> None:
    ch, stub = plain_stub(plain)
    with ch:
        stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=RPC_TIMEOUT_S)
        for worker in ("9" * 5000, "-1", "1e3"):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Push(iter([pb.PushChunk(header=pb.PushHeader(round=0, total_bytes=10))]),
                          metadata=((transport.WORKER_ID_KEY, worker), (transport.SESSION_KEY, "s")),
                          timeout=RPC_TIMEOUT_S)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, worker
        with pytest.raises(grpc.RpcError) as unknown:
            list(stub.FetchState(pb.FetchStateRequest(worker_id=2, session="s"), timeout=RPC_TIMEOUT_S))
        assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "known ids" not in unknown.value.details() and "[0]" not in unknown.value.details()
    assert not any(r.exc_info for r in caplog.records)


def test_registry_json_is_written_only_when_it_changes(plain) -> None:
    ch, stub = plain_stub(plain)
    path = plain.run_dir / REGISTRY_FILE
    with ch:
        first = stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION, capabilities=pb.Capabilities(hostname="a")),
                          timeout=RPC_TIMEOUT_S)
        written = path.stat().st_ino
        stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION, capabilities=pb.Capabilities(hostname="a"),
                                 reclaim_worker_id=first.worker_id, reclaim_session=first.session),
                  timeout=RPC_TIMEOUT_S)
        assert path.stat().st_ino == written  # the same registry: not written again
        stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION, capabilities=pb.Capabilities(hostname="b")),
                  timeout=RPC_TIMEOUT_S)
        assert path.stat().st_ino != written


def test_a_thousand_idle_metrics_connections_keep_its_threads_bounded() -> None:
    registry = CollectorRegistry()
    PromCounter("geoloco_probe", "a probe", registry=registry).inc()
    before = threading.active_count()
    server = MetricsServer(registry, "127.0.0.1", 0)
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
        body = scrape(server.port)  # served once the idle ones above have been accepted
        held = threading.active_count() - before
        print(json.dumps({"idle_metrics_connections": len(idle), "threads_held": held,
                          "max_connections": MAX_CONNECTIONS}))
        assert "geoloco_probe_total 1.0" in body
        assert held <= MAX_CONNECTIONS + 2  # the serving thread, and one handler finishing
    finally:
        for s in idle:
            s.close()
        server.close()


def scrape(port: int, limit_s: float = 60.0) -> str:
    """GET /metrics, again while the server is full (it closes a connection beyond its share)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                return reply.read().decode()
        except (OSError, http.client.HTTPException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
