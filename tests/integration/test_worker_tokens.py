"""Per-worker tokens against real processes: a `geoloco coordinator` started with
--worker-tokens-file (what `geoloco certs` writes) refuses the shared token, and two
`geoloco worker` processes, each with only its own token file, take the slots their tokens
bind (started in reverse order) and finish on the coordinator's digest."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from run_processes import (
    SMALL,
    TOKEN,
    Processes,
    coordinator_port,
    final_coordinator_digest,
    set_flags,
    worker_reports,
)

from geoloco import transport
from geoloco.certs import WORKER_TOKENS_FILE, make_run_credentials, worker_token
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc

pytestmark = pytest.mark.slow
ROUNDS = 2


def test_each_worker_joins_with_its_own_token_and_the_shared_token_is_refused(processes: Processes,
                                                                             tmp_path: Path) -> None:
    creds, run_dir, reports = tmp_path / "creds", tmp_path / "run", tmp_path / "reports"
    make_run_credentials(creds, None, 2)
    processes.start("coordinator", [
        "coordinator", "--listen", "127.0.0.1:0", "--workers", "2", "--rounds", str(ROUNDS),
        "--run-dir", str(run_dir), "--worker-tokens-file", str(creds / WORKER_TOKENS_FILE),
        *set_flags({**SMALL, "coordinator.checkpoint_every": "0"})])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"
    # the shared token (every test process has it) is refused
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
        geoloco_pb2_grpc.CoordinatorStub(channel).Join(
            pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION), timeout=30)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    for i in (1, 0):
        processes.start(f"worker-{i}", ["worker", "--coordinator", address, "--device", "cpu",
                                        "--token-file", str(creds / worker_token(i)),
                                        "--report-dir", str(reports)])
    assert processes.wait("coordinator", timeout=240) == 0, processes.log("coordinator")[-3000:]
    for i in (0, 1):
        assert processes.wait(f"worker-{i}", timeout=60) == 0, processes.log(f"worker-{i}")[-3000:]
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    for i in (0, 1):
        assert finished[i]["pid"] == processes.procs[f"worker-{i}"].pid  # the slot its token binds
        assert finished[i]["status"] == "finished" and finished[i]["digest"] == digest
