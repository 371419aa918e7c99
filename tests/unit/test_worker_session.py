"""The worker's session seam (geoloco.worker.session, .stream, .faults) against real gRPC
servers on loopback: what a push puts on the wire, a round result decoded and applied as
it streams in, a stream cut before its digest, and faulty sessions that drop a push, cut
the stream or flip a parameter under real workers and a real coordinator process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from geoloco import transport
from geoloco.compression import Compressor, FrameError, Layout, decode_frame
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.replica import apply_round, param_digest
from geoloco.worker.faults import FLIP_BY, Fault, FaultySession, FlippingResult
from geoloco.worker.loop import Worker
from geoloco.worker.session import Push, Session
from geoloco.worker.stream import DigestCheck, Disconnected

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "seam"


class ScriptedCoordinator(pb_grpc.CoordinatorServicer):
    """Answers Join, records pushes, and sends a fixed list of round updates on Rounds."""

    def __init__(self, updates: list[pb.RoundUpdate], hold_open: bool = False) -> None:
        self.updates = updates
        self.hold_open = hold_open  # keep the stream open after the updates until cancelled
        self.pushes: list[list[pb.PushChunk]] = []

    def Join(self, request, context):  # noqa: N802 - gRPC method names
        return pb.JoinReply(worker_id=1, session="secret", current_round=0)

    def Push(self, request_iterator, context):  # noqa: N802
        self.pushes.append(list(request_iterator))
        return pb.PushReply(accepted=True, round=self.pushes[-1][0].header.round)

    def Rounds(self, request, context):  # noqa: N802
        yield from self.updates
        if self.hold_open:
            done = threading.Event()
            context.add_callback(done.set)
            done.wait(timeout=30)


@pytest.fixture
def serve() -> Iterator[Callable[[ScriptedCoordinator], str]]:
    """Starts a ScriptedCoordinator on loopback; returns its address."""
    servers = []

    def start(servicer: ScriptedCoordinator) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=transport.SERVER_OPTIONS)
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def small_layout() -> Layout:
    return Layout.from_named_tensors([("w", torch.zeros(64, 64)), ("b", torch.zeros(64))])


def sparse_frames(layout: Layout, senders: int) -> list[bytes]:
    gen = torch.Generator().manual_seed(0)
    frames = []
    for sender in range(senders):
        deltas = [torch.randn(s.shape, generator=gen) for s in layout.specs]
        frames.append(Compressor(layout).compress(deltas, round=0, sender=sender))
    return frames


def round_updates(frames: list[bytes], digest: str | None) -> list[pb.RoundUpdate]:
    """Round 0's header, each frame in two data chunks, then its digest (if given)."""
    header = pb.RoundHeader(round=0, aggregation="sum", alpha=-1.0, next_task=pb.WorkerTask(round=1),
                            frames=[pb.FrameInfo(sender=i, weight=0.5, nbytes=len(f)) for i, f in enumerate(frames)])
    updates = [pb.RoundUpdate(header=header)]
    for f in frames:
        half = len(f) // 2
        updates += [pb.RoundUpdate(data=f[:half]), pb.RoundUpdate(data=f[half:])]
    if digest is not None:
        updates.append(pb.RoundUpdate(digest=pb.RoundDigest(round=0, digest=digest)))
    return updates


def expected_after(layout: Layout, frames: list[bytes]) -> list[torch.Tensor]:
    params = [torch.zeros(s.shape) for s in layout.specs]
    apply_round(params, [decode_frame(f, layout) for f in frames], [0.5] * len(frames), "sum", -1.0)
    return params


def test_push_sends_the_header_fields_then_the_frame_in_chunks(serve) -> None:
    servicer = ScriptedCoordinator([])
    session = Session(serve(servicer), TOKEN, connect_timeout_s=10)
    session.join("cpu")
    frame = bytes(range(256)) * (transport.CHUNK_BYTES // 256 + 3)
    reply = session.push(Push(round=3, frame=frame, compute_s=1.5, train_loss=2.25, partitions=[1, 2],
                              encode_s=0.25, apply_s=0.125))
    assert reply.accepted
    (chunks,) = servicer.pushes
    header = chunks[0].header
    assert (header.worker_id, header.session, header.round, header.total_bytes) == (1, "secret", 3, len(frame))
    assert (header.compute_seconds, header.train_loss, list(header.partitions)) == (1.5, 2.25, [1, 2])
    assert (header.encode_seconds, header.apply_seconds) == (0.25, 0.125)
    assert len(chunks) == 3 and b"".join(c.data for c in chunks[1:]) == frame
    session.close()


def test_faulty_session_drops_the_push_of_its_round_only(serve) -> None:
    servicer = ScriptedCoordinator([])
    session = FaultySession(serve(servicer), TOKEN, 10, fault=Fault.DROP_PUSH, rounds=[3])
    session.join("cpu")
    dropped = session.push(Push(round=3, frame=b"frame", compute_s=0.0, train_loss=0.0))
    assert not dropped.accepted and "drop" in dropped.reason
    assert servicer.pushes == []  # nothing reached the coordinator
    assert session.push(Push(round=4, frame=b"frame", compute_s=0.0, train_loss=0.0)).accepted
    assert len(servicer.pushes) == 1 and session.fired == [3]
    session.close()


def test_round_result_is_applied_as_it_streams_in_and_matches_apply_round(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 2)
    expected = expected_after(layout, frames)
    session = Session(serve(ScriptedCoordinator(round_updates(frames, param_digest(expected)))), TOKEN, 10)
    session.join("cpu")
    session.follow(0, layout)
    result = session.next_result(0)
    theta = [torch.zeros(s.shape) for s in layout.specs]
    assert result.apply_to(theta) >= 0.0
    assert all(torch.equal(t, e) for t, e in zip(theta, expected, strict=True))
    assert result.nbytes == sum(len(f) for f in frames)
    assert DigestCheck(result.header, theta, result.digest).outcome()
    with pytest.raises(Disconnected, match="closed the Rounds stream"):
        session.next_result(1)
    session.close()


def test_stream_that_ends_before_the_digest_leaves_theta_unconfirmed(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 1)
    session = Session(serve(ScriptedCoordinator(round_updates(frames, digest=None))), TOKEN, 10)
    session.join("cpu")
    session.follow(0, layout)
    result = session.next_result(0)
    theta = [torch.zeros(s.shape) for s in layout.specs]
    result.apply_to(theta)  # every frame came
    check = DigestCheck(result.header, theta, result.digest)
    assert not check.release()
    with pytest.raises(Disconnected, match="cut off"):
        DigestCheck(result.header, theta, result.digest).outcome()
    session.close()


def test_a_frame_that_does_not_decode_fails_the_apply(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 2)
    broken = bytearray(frames[1])
    broken[len(broken) // 2] ^= 0xFF
    session = Session(serve(ScriptedCoordinator(round_updates([frames[0], bytes(broken)], "x"))), TOKEN, 10)
    session.join("cpu")
    session.follow(0, layout)
    with pytest.raises(FrameError, match="frame from worker 1"):
        session.next_result(0).apply_to([torch.zeros(s.shape) for s in layout.specs])
    session.close()


def test_cut_stream_ends_the_result_being_taken(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 1)
    header_only = round_updates(frames, digest=None)[:1]  # the frame never comes
    session = FaultySession(serve(ScriptedCoordinator(header_only, hold_open=True)), TOKEN, 10,
                            fault=Fault.CUT_STREAM, rounds=[0])
    session.join("cpu")
    session.follow(0, layout)
    result = session.next_result(0)
    with pytest.raises(Disconnected, match="cut off"):
        result.apply_to([torch.zeros(s.shape) for s in layout.specs])
    with pytest.raises(Disconnected):
        session.poll_result(1)
    session.close()


def test_flipping_result_changes_one_parameter_before_applying(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 1)
    session = FaultySession(serve(ScriptedCoordinator(round_updates(frames, "x"))), TOKEN, 10,
                            fault=Fault.FLIP_PARAMETER, rounds=[0])
    session.join("cpu")
    session.follow(0, layout)
    result = session.next_result(0)
    assert isinstance(result, FlippingResult)
    theta = [torch.zeros(s.shape) for s in layout.specs]
    result.apply_to(theta)
    expected = [torch.zeros(s.shape) for s in layout.specs]
    expected[0].view(-1)[0] += FLIP_BY
    apply_round(expected, [decode_frame(frames[0], layout)], [0.5], "sum", -1.0)
    assert all(torch.equal(t, e) for t, e in zip(theta, expected, strict=True))
    session.close()


# ---------------------------------------------------------------- real coordinator, real workers

RUN = {
    "task.model": "gpt-tiny", "task.seq_len": "32", "task.batch_size": "4", "task.val_windows": "4",
    "task.corpus_bytes": "200000", "inner.steps": "2", "inner.warmup_steps": "2",
    "coordinator.checkpoint_every": "0", "coordinator.join_timeout_s": "60",
}
ROUNDS = 3


def run_two_workers(tmp_path: Path, faulty: FaultySession, deadline_s: float = 60.0) -> tuple[Worker, Worker]:
    """A coordinator process (``geoloco coordinator``) and two in-process workers, one over
    ``faulty``, until the run is over; both must exit 0."""
    run_dir = tmp_path / "run"
    flags = [arg for k, v in {**RUN, "coordinator.deadline_s": str(deadline_s)}.items() for arg in ("--set", f"{k}={v}")]
    log = open(tmp_path / "coordinator.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "geoloco.cli", "coordinator", "--listen", "127.0.0.1:0",
                             "--workers", "2", "--rounds", str(ROUNDS), "--run-dir", str(run_dir), *flags],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", GEOLOCO_TOKEN=TOKEN))
    try:
        address = f"127.0.0.1:{read_port(run_dir, proc)}"
        faulty.address = address
        workers = [Worker(faulty, device="cpu"), Worker(Session(address, TOKEN, 30), device="cpu")]
        codes: dict[int, int] = {}
        threads = [threading.Thread(target=lambda i=i, w=w: codes.__setitem__(i, w.run()), daemon=True)
                   for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert codes == {0: 0, 1: 0}, (tmp_path / "coordinator.log").read_text()[-3000:]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    return workers[0], workers[1]


def read_port(run_dir: Path, proc: subprocess.Popen) -> int:
    port_file = run_dir / "coordinator.port"
    for _ in range(1200):
        if port_file.exists() and port_file.read_text().strip().isdigit():
            return int(port_file.read_text())
        assert proc.poll() is None, "the coordinator exited before writing its port"
        threading.Event().wait(0.05)
    raise AssertionError("the coordinator did not write its port in 60 s")


def metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def end_in_step(faulty: Worker, punctual: Worker) -> None:
    """The punctual worker confirmed every digest (no resync), so ending on its parameters
    is ending on the coordinator's."""
    assert punctual.counters.resyncs == 0
    assert param_digest(faulty.theta) == param_digest(punctual.theta)
    assert faulty.round == punctual.round == ROUNDS


def test_a_dropped_push_is_counted_and_the_round_closes_without_it(tmp_path: Path) -> None:
    session = FaultySession("", TOKEN, 30, fault=Fault.DROP_PUSH, rounds=[1])
    faulty, punctual = run_two_workers(tmp_path, session, deadline_s=5.0)
    assert session.fired == [1]
    assert faulty.counters.rejected_pushes == 1 and faulty.counters.resyncs == 0
    closed = metrics(tmp_path)
    assert [sorted(m["arrived"]) for m in closed] == [[0, 1], [punctual.session.worker_id], [0, 1]]
    end_in_step(faulty, punctual)


def test_a_flipped_parameter_is_found_by_the_digest_and_resynced(tmp_path: Path) -> None:
    session = FaultySession("", TOKEN, 30, fault=Fault.FLIP_PARAMETER, rounds=[1])
    faulty, punctual = run_two_workers(tmp_path, session)
    assert session.fired == [1]
    assert faulty.counters.resyncs == 1
    end_in_step(faulty, punctual)


def test_a_cut_stream_makes_the_worker_rejoin_with_its_id(tmp_path: Path) -> None:
    session = FaultySession("", TOKEN, 30, fault=Fault.CUT_STREAM, rounds=[1])
    faulty, punctual = run_two_workers(tmp_path, session)
    assert session.fired == [1]
    assert faulty.counters.reconnects == 1
    # it kept its id: no third worker, and its frame of the last round came under that id
    assert sorted(metrics(tmp_path)[-1]["arrived"]) == [0, 1]
    end_in_step(faulty, punctual)
