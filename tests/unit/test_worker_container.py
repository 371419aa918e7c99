"""The worker container's root step (geoloco.worker.container): the identity file and the
Join against a real gRPC server on loopback."""

from __future__ import annotations

import json
import stat
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from geoloco.protos import geoloco_pb2, geoloco_pb2_grpc
from geoloco.transport import PROTOCOL_VERSION, CoordinatorUnreachable, JoinRefused
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
