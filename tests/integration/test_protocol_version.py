"""The wire version at Join (geoloco.transport.PROTOCOL_VERSION): a coordinator refuses a
worker of another version, and a worker refuses a coordinator of another version (one
whose JoinReply lacks the field speaks version 1), each with an error naming both
versions; a `geoloco worker` process exits non-zero with it."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from run_processes import ROOT, SMALL, TOKEN

from geoloco import transport
from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.transport import JoinRefused
from geoloco.worker.session import Session

pytestmark = pytest.mark.slow


def test_the_coordinator_refuses_a_worker_of_another_version(tmp_path: Path) -> None:
    cfg = load_config(overrides={**SMALL, "coordinator.token": TOKEN, "workers": "1", "rounds": "1",
                                 "coordinator.listen": "127.0.0.1:0", "coordinator.checkpoint_every": "0"})
    coordinator = Coordinator(cfg, tmp_path / "run")
    port = coordinator.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            for old in (0, 1):  # a version-1 worker sends no field: 0 on the wire
                with pytest.raises(grpc.RpcError) as err:
                    stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=old), timeout=10)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert err.value.details() == (
                    f"protocol version mismatch: this coordinator speaks geoloco wire protocol "
                    f"{transport.PROTOCOL_VERSION}, the worker 1; run the same geoloco version on both sides")
            reply = stub.Join(pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION),
                              timeout=10)
            assert reply.protocol_version == transport.PROTOCOL_VERSION
    finally:
        coordinator.stop(grace=0.5)


class VersionOneCoordinator(pb_grpc.CoordinatorServicer):
    """Answers Join as a coordinator of wire version 1 does: without protocol_version."""

    def Join(self, request, context):  # noqa: N802 - gRPC method names
        return pb.JoinReply(worker_id=0, session="s", current_round=0)


@pytest.fixture
def old_coordinator():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=transport.SERVER_OPTIONS)
    pb_grpc.add_CoordinatorServicer_to_server(VersionOneCoordinator(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=0)


def test_a_worker_refuses_a_coordinator_of_another_version(old_coordinator: str) -> None:
    session = Session(old_coordinator, TOKEN, connect_timeout_s=10)
    with pytest.raises(JoinRefused) as err:
        session.join("cpu")
    assert str(err.value) == (
        f"protocol version mismatch: this worker speaks geoloco wire protocol "
        f"{transport.PROTOCOL_VERSION}, the coordinator 1; run the same geoloco version on both sides")
    session.close()


def test_a_worker_process_exits_with_the_mismatch(old_coordinator: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "geoloco.cli", "worker", "--coordinator", old_coordinator,
                           "--device", "cpu", "--connect-timeout", "10"],
                          cwd=ROOT, env={"GEOLOCO_TOKEN": TOKEN, "PATH": "/usr/bin:/bin",
                                         "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "the coordinator 1" in proc.stdout + proc.stderr
