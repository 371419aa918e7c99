"""The worker container's root step (geoloco.worker.container): the identity file and the
Join against a real gRPC server on loopback."""

from __future__ import annotations

import json
import stat
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from geoloco.protos import geoloco_pb2, geoloco_pb2_grpc
from geoloco.transport import (
    PROTOCOL_VERSION,
    CoordinatorUnreachable,
    JoinRefused,
    join_with_backoff,
)
from geoloco.worker import container


def test_identity_file_round_trip(tmp_path: Path) -> None:
    ident = container.Identity(worker_id=3, session="s3", wan_profile="20mbit/50ms", straggler_profile="fixed:2",
                        emulate="unlimited/50ms/0ms")
    path = tmp_path / "run" / "identity.json"
    ident.write(path)
    assert container.Identity(**json.loads(path.read_text())) == ident
    assert not path.with_name("identity.json.tmp").exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the worker's session


class JoinOnly(geoloco_pb2_grpc.CoordinatorServicer):
    """A coordinator that only answers Join: worker 2 for the right token."""

    def Join(self, request, context):  # noqa: N802 - gRPC method name
        if request.token != "right":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "bad token")
        if request.protocol_version != PROTOCOL_VERSION:  # the container's Join says its version
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"protocol {request.protocol_version}")
        return geoloco_pb2.JoinReply(worker_id=2, session="abc", wan_profile="10mbit/30ms",
                                     straggler_profile="exp:0.1:0.5",
                                     protocol_version=PROTOCOL_VERSION)


@pytest.fixture
def join_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    geoloco_pb2_grpc.add_CoordinatorServicer_to_server(JoinOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_join_returns_the_assigned_identity(join_server: str) -> None:
    ident = container.join_coordinator(join_server, "right", timeout_s=10)
    assert (ident.worker_id, ident.session, ident.wan_profile, ident.straggler_profile) == (
        2, "abc", "10mbit/30ms", "exp:0.1:0.5")


def test_join_refusal_is_not_retried(join_server: str) -> None:
    with pytest.raises(JoinRefused, match="PERMISSION_DENIED: bad token"):
        container.join_coordinator(join_server, "wrong", timeout_s=10)


def test_join_gives_up_on_an_unreachable_coordinator() -> None:
    with pytest.raises(CoordinatorUnreachable, match="unreachable"):
        container.join_coordinator("127.0.0.1:1", "right", timeout_s=1.0)


class SlowJoin(JoinOnly):
    """JoinOnly whose answer takes ``delay_s``: a link with seconds of round trip, where
    TLS and HTTP/2 take several before Join's reply arrives."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def Join(self, request, context):  # noqa: N802 - gRPC method name
        time.sleep(self.delay_s)
        return super().Join(request, context)


@pytest.fixture
def slow_join_server():
    servicer = SlowJoin(delay_s=0.8)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))  # attempts given up keep a thread
    geoloco_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def _join(deadline_log: list[float]):
    request = geoloco_pb2.JoinRequest(token="right", protocol_version=PROTOCOL_VERSION)

    def call(channel: grpc.Channel, deadline_s: float) -> geoloco_pb2.JoinReply:
        deadline_log.append(deadline_s)
        return geoloco_pb2_grpc.CoordinatorStub(channel).Join(request, timeout=deadline_s)
    return call


def test_join_lengthens_its_deadline_until_a_slow_link_answers(slow_join_server) -> None:
    address, servicer = slow_join_server
    deadlines: list[float] = []
    reply, channel = join_with_backoff(address, _join(deadlines), timeout_s=60, sleep=lambda s: None,
                                       call_timeout_s=0.125)
    channel.close()
    assert reply.worker_id == 2
    # the attempts that ran out of time each doubled the next one's deadline, until one
    # was long enough (a fixed 0.125 s would never have joined)
    assert deadlines[:3] == [0.125, 0.25, 0.5] and len(deadlines) >= 4
    assert all(b == 2 * a for a, b in zip(deadlines, deadlines[1:], strict=False))
    assert deadlines[-1] >= servicer.delay_s


def test_join_that_keeps_timing_out_says_how_to_wait_longer(slow_join_server) -> None:
    address, _ = slow_join_server
    with pytest.raises(CoordinatorUnreachable, match="got no answer in .*raise worker.connect_timeout_s"):
        join_with_backoff(address, _join([]), timeout_s=0.3, sleep=lambda s: None, call_timeout_s=0.1)
