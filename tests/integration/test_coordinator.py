"""The real coordinator on a loopback port, driven by raw gRPC clients built from the stubs
and the real codec: bad calls are refused with a reason and leave the round untouched, good
rounds reproduce the header digest, deadlines close rounds, checkpoints resume."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from run_processes import wait_until

from geoloco import replica as state
from geoloco import transport as wire
from geoloco.compression import Compressor, Layout, decode_frame, encode_dense
from geoloco.config import load_config
from geoloco.coordinator import limits, service
from geoloco.coordinator.app import Coordinator
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc

TOKEN = "test-token"
RPC_TIMEOUT_S = 60.0


def make_config(**overrides):
    base = {
        "workers": 2, "rounds": 3, "seed": 0,
        "task.model": "gpt-tiny", "task.seq_len": 16, "task.batch_size": 4,
        "task.val_windows": 4, "task.corpus_bytes": 100_000,
        "coordinator.listen": "127.0.0.1:0", "coordinator.token": TOKEN,
        "coordinator.deadline_s": 60.0, "coordinator.join_timeout_s": 60.0,
        "coordinator.checkpoint_every": 0,
    }
    base.update(overrides)
    return load_config(overrides=base)


@contextmanager
def running(cfg, run_dir: Path, resume: bool = False) -> Iterator[Coordinator]:
    coordinator = Coordinator(cfg, run_dir, resume=resume)
    coordinator.start()
    try:
        yield coordinator
    finally:
        coordinator.stop(grace=0.5)


class RawWorker:
    """A worker reduced to the wire: stubs, the codec, and nothing of worker/."""

    def __init__(self, port: int, cfg) -> None:
        self.cfg = cfg
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.CHANNEL_OPTIONS)
        self.stub = geoloco_pb2_grpc.CoordinatorStub(self.channel)
        self.rounds_call = None

    def join(self, token: str = TOKEN, **kwargs) -> pb.JoinReply:
        reply = self.stub.Join(pb.JoinRequest(token=token, **{"protocol_version": wire.PROTOCOL_VERSION, **kwargs}), timeout=RPC_TIMEOUT_S)
        self.id, self.session = reply.worker_id, reply.session
        self.layout_digest = reply.layout_digest
        return reply

    def fetch_state(self, layout: Layout) -> tuple[int, str, list[torch.Tensor]]:
        chunks = list(self.stub.FetchState(
            pb.FetchStateRequest(worker_id=self.id, session=self.session), timeout=RPC_TIMEOUT_S))
        data = b"".join(c.data for c in chunks)
        assert len(data) == chunks[0].total_bytes
        params = [t.clone() for t in decode_frame(data, layout).to_dense("cpu")]
        assert state.param_digest(params) == chunks[0].digest
        self.task = chunks[0].task
        return chunks[0].round, chunks[0].digest, params

    def follow(self, from_round: int) -> None:
        self.rounds_call = self.stub.Rounds(
            pb.RoundsRequest(worker_id=self.id, session=self.session, from_round=from_round),
            timeout=RPC_TIMEOUT_S)

    def next_round(self) -> tuple[pb.RoundHeader, bytes, str]:
        """The next RoundHeader, its frame bytes and the digest that ends it (keepalives
        skipped); the digest must come after all the frame bytes."""
        header, data = None, b""
        for update in self.rounds_call:
            if update.HasField("header"):
                assert header is None, "a second header before the digest"
                header = update.header
            elif update.HasField("data"):
                data += update.data
            elif update.HasField("digest"):
                assert header is not None and update.digest.round == header.round
                assert len(data) == sum(f.nbytes for f in header.frames), "digest before the data"
                return header, data, update.digest.digest
        raise AssertionError("Rounds stream ended before a round result")

    def push(self, round: int, data: bytes, worker_id: int | None = None, session: str | None = None,
             total_bytes: int | None = None, send: bytes | None = None) -> pb.PushReply:
        header = pb.PushHeader(
            worker_id=self.id if worker_id is None else worker_id,
            session=self.session if session is None else session, round=round,
            total_bytes=len(data) if total_bytes is None else total_bytes,
            compute_seconds=0.5, train_loss=3.0, partitions=[self.id], encode_seconds=0.25,
            apply_seconds=0.125)
        body = data if send is None else send
        msgs = [pb.PushChunk(header=header)] + [pb.PushChunk(data=c) for c in wire.chunks(body)]
        return self.stub.Push(iter(msgs), timeout=RPC_TIMEOUT_S,
                              metadata=wire.caller_metadata(header.worker_id, header.session))

    def close(self) -> None:
        if self.rounds_call is not None:
            self.rounds_call.cancel()
        self.channel.close()


@pytest.fixture
def workers():
    made: list[RawWorker] = []

    def make(port: int, cfg) -> RawWorker:
        made.append(RawWorker(port, cfg))
        return made[-1]

    yield make
    for w in made:
        w.close()


def sparse_frame(cfg, layout: Layout, worker: int, round: int) -> bytes:
    gen = torch.Generator().manual_seed(1000 * round + worker)
    deltas = [torch.randn(s.shape, generator=gen) * 1e-3 for s in layout.specs]
    compressor = Compressor(layout, density=cfg.compression.density, beta=cfg.compression.ef_beta,
                            tile=cfg.compression.tile)
    return compressor.compress(deltas, round=round, sender=worker)


def apply_round(params: list[torch.Tensor], layout: Layout, header: pb.RoundHeader,
                data: bytes) -> str:
    frames, offset = [], 0
    for info in header.frames:
        frames.append(decode_frame(data[offset:offset + info.nbytes], layout))
        offset += info.nbytes
    state.apply_round(params, frames, [f.weight for f in header.frames], header.aggregation,
                      header.alpha)
    return state.param_digest(params)


def first_metrics_line(run_dir: Path) -> dict:
    """Round 0's metrics line: written after the broadcast (and the validation loss), so
    it may lag the round result a little."""
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + RPC_TIMEOUT_S
    while not (path.exists() and path.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "no metrics line after round 0"
        time.sleep(0.05)
    return json.loads(path.read_text().splitlines()[0])


def joined(coordinator: Coordinator, make, n: int) -> list[RawWorker]:
    out = []
    for _ in range(n):
        w = make(coordinator.port, coordinator.cfg)
        w.join(capabilities=pb.Capabilities(device="cpu", hostname="test"))
        out.append(w)
    return out


def rejected(reply: pb.PushReply, *words: str) -> None:
    assert not reply.accepted, "a bad push was accepted"
    for word in words:
        assert word in reply.reason, f"{word!r} not in reason {reply.reason!r}"


def test_health_and_wrong_token(tmp_path, workers):
    cfg = make_config()
    with running(cfg, tmp_path / "run") as coordinator:
        channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="geoloco.v1.Coordinator"), timeout=10)
        channel.close()
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert (tmp_path / "run" / "coordinator.port").read_text().strip() == str(coordinator.port)
        w = workers(coordinator.port, cfg)
        with pytest.raises(grpc.RpcError) as err:
            w.join(token="not-the-token")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "wrong token" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            w.join(reclaim_worker_id=0, reclaim_session="forged")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_bad_pushes_are_rejected_and_the_round_completes(tmp_path, workers):
    cfg = make_config()
    with running(cfg, tmp_path / "run") as coordinator:
        a, b = joined(coordinator, workers, 2)
        layout = coordinator.layout
        assert a.layout_digest == layout.digest
        r, digest, params = a.fetch_state(layout)
        assert r == 0 and list(a.task.train_partitions) == [a.id]
        a.follow(0)
        b.follow(0)
        good_a, good_b = sparse_frame(cfg, layout, a.id, 0), sparse_frame(cfg, layout, b.id, 0)

        for kwargs, why in (({"worker_id": 7}, "unknown worker 7"), ({"session": "forged"}, "bad session")):
            with pytest.raises(grpc.RpcError) as refused:  # before the stream is read
                a.push(0, good_a, **kwargs)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and why in refused.value.details()
        rejected(a.push(1, sparse_frame(cfg, layout, a.id, 1)), "round 1", "round 0")
        other = Layout.from_named_tensors([("w", torch.zeros(64, 64))])
        rejected(a.push(0, sparse_frame(cfg, other, a.id, 0)), "layout")
        rejected(a.push(0, good_a[:-7]), "")  # truncated, honest length: the codec refuses it
        rejected(a.push(0, good_a, send=good_a[:-7]), "truncated")
        flipped = bytearray(good_a)
        flipped[len(flipped) // 2] ^= 0x10
        rejected(a.push(0, bytes(flipped)), "")
        rejected(a.push(0, good_b), "worker")  # b's frame under a's name
        cut_mid_frame(a, good_a)

        assert a.push(0, good_a).accepted  # nothing above took a's slot in round 0
        rejected(a.push(0, good_a), "already pushed")
        assert b.push(0, good_b).accepted
        ha, da, ga = a.next_round()
        hb, db, gb = b.next_round()
        assert ha.round == 0 and list(ha.arrived) == [0, 1] and not ha.finished
        assert ga == gb and da == db and ha.frames == hb.frames
        assert da == good_a + good_b
        assert apply_round(params, layout, ha, da) == ga == coordinator.digest()
        assert list(ha.next_task.train_partitions) == [a.id]
        assert list(hb.next_task.train_partitions) == [b.id]

        rejected(a.push(0, good_a), "frame for round 0 but round 1")
        line = first_metrics_line(tmp_path / "run")
        assert line["round"] == 0 and line["arrived"] == [0, 1]
        assert line["rejected_frames"] >= 8
        assert line["upload_bytes"] == {"0": len(good_a), "1": len(good_b)}
        assert (line["compute_seconds_max"], line["encode_seconds"], line["encode_seconds_max"],
                line["worker_apply_seconds_max"]) == (0.5, 0.25, 0.25, 0.125)  # as pushed
        assert line["close_seconds"] >= 0 and line["coordinator_apply_seconds"] >= 0
        assert line["val_loss"] is not None  # measured after the broadcast, still recorded


def cut_mid_frame(w: RawWorker, data: bytes) -> None:
    """Push a header and half the frame, then cancel the call as a dying worker would."""
    release = threading.Event()

    def messages():
        yield pb.PushChunk(header=pb.PushHeader(worker_id=w.id, session=w.session, round=0,
                                                total_bytes=len(data)))
        yield pb.PushChunk(data=data[: len(data) // 2])
        release.wait(10)

    future = w.stub.Push.future(messages(), timeout=RPC_TIMEOUT_S, metadata=wire.caller_metadata(w.id, w.session))
    time.sleep(0.3)
    future.cancel()
    release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    time.sleep(0.2)


def test_deadline_closes_round_without_a_worker(tmp_path, workers, monkeypatch):
    monkeypatch.setattr(wire, "KEEPALIVE_S", 0.2)
    cfg = make_config(**{"coordinator.deadline_s": 1.5})
    with running(cfg, tmp_path / "run") as coordinator:
        a, b = joined(coordinator, workers, 2)
        _, _, params = a.fetch_state(coordinator.layout)
        a.follow(0)
        b.follow(0)  # b follows but never pushes: a dead straggler
        first = next(iter(b.rounds_call))
        assert first.HasField("keepalive") and first.keepalive.round == 0
        frame = sparse_frame(cfg, coordinator.layout, a.id, 0)
        assert a.push(0, frame).accepted
        started = time.monotonic()
        header, data, digest = a.next_round()
        assert time.monotonic() - started < 10
        assert list(header.arrived) == [a.id] and [f.sender for f in header.frames] == [a.id]
        assert header.frames[0].weight == 1.0  # the mean over the one arrived frame
        assert apply_round(params, coordinator.layout, header, data) == digest
        assert b.next_round()[2] == digest
        line = first_metrics_line(tmp_path / "run")
        assert line["close_reason"] == "deadline"


def test_reconnected_rounds_stream_replays_missed_results(tmp_path, workers):
    cfg = make_config(workers=1)
    with running(cfg, tmp_path / "run") as coordinator:
        (a,) = joined(coordinator, workers, 1)
        a.fetch_state(coordinator.layout)
        a.follow(0)
        for r in range(2):
            assert a.push(r, sparse_frame(cfg, coordinator.layout, a.id, r)).accepted
            a.next_round()
        a.rounds_call.cancel()
        a.follow(0)
        assert [a.next_round()[0].round for _ in range(2)] == [0, 1]


def test_full_run_finishes_and_resume_restores_round_and_params(tmp_path, workers):
    run_dir = tmp_path / "run"
    cfg = make_config(workers=1, rounds=3, **{"coordinator.checkpoint_every": 1,
                                              "coordinator.val_every": 2})
    with running(cfg, run_dir) as coordinator:
        (a,) = joined(coordinator, workers, 1)
        a.fetch_state(coordinator.layout)
        a.follow(0)
        assert a.push(0, sparse_frame(cfg, coordinator.layout, a.id, 0)).accepted
        _, _, round0_digest = a.next_round()
        deadline = time.monotonic() + 30
        while not list((run_dir / "checkpoints").glob("round_00000001")):
            assert time.monotonic() < deadline, "no checkpoint after round 0"
            time.sleep(0.05)
        session = a.session
    a.close()

    with running(cfg, run_dir, resume=True) as resumed:
        assert resumed.open_round() == 1 and resumed.digest() == round0_digest
        w = workers(resumed.port, cfg)
        reply = w.join(reclaim_worker_id=0, reclaim_session=session)
        assert reply.worker_id == 0 and reply.current_round == 1
        r, digest, params = w.fetch_state(resumed.layout)
        assert (r, digest) == (1, round0_digest)
        w.follow(1)
        for r in (1, 2):
            assert w.push(r, sparse_frame(cfg, resumed.layout, 0, r)).accepted
            h, data, digest = w.next_round()
            assert apply_round(params, resumed.layout, h, data) == digest
        assert h.finished and h.round == 2
        w.close()  # a worker hangs up once it has the last result; the run then ends
        assert resumed.wait(timeout=30)
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("rounds", "initial_val_loss", "final_val_loss", "upload_bytes_per_worker_round",
                "dense_fp32_bytes", "digest_mismatches", "wall_seconds"):
        assert key in summary
    assert summary["rounds"] == 3 and summary["dense_fp32_bytes"] > 4 * resumed.layout.numel - 1
    assert summary["upload_bytes_per_worker_round"] < summary["dense_fp32_bytes"] / 10
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["val_loss"] is not None for m in lines] == [False, True, True]  # val_every 2, last
    assert summary["final_val_loss"] == lines[-1]["val_loss"]


def test_diloco_broadcasts_one_dense_nesterov_frame(tmp_path, workers):
    cfg = make_config(**{"compression.method": "diloco"})
    with running(cfg, tmp_path / "run") as coordinator:
        a, b = joined(coordinator, workers, 2)
        layout = coordinator.layout
        _, _, params = a.fetch_state(layout)
        a.follow(0)
        b.follow(0)  # round 0 opens once every joined worker fetched state or follows
        gen = torch.Generator().manual_seed(0)
        deltas = {w.id: [torch.randn(s.shape, generator=gen) * 1e-3 for s in layout.specs]
                  for w in (a, b)}
        sparse = sparse_frame(cfg, layout, a.id, 0)
        rejected(a.push(0, sparse), "sparse")
        for w in (a, b):
            frame = encode_dense(layout, deltas[w.id], round=0, sender=w.id, dtype="fp32")
            assert w.push(0, frame).accepted
        header, data, digest = a.next_round()
        assert len(header.frames) == 1 and header.alpha == 1.0 and header.aggregation == "sum"
        before = [p.clone() for p in params]
        assert apply_round(params, layout, header, data) == digest
        lr, mu = cfg.outer.lr, cfg.outer.momentum
        for j, (p0, p1) in enumerate(zip(before, params, strict=True)):
            mean = (deltas[0][j] + deltas[1][j]) / 2
            torch.testing.assert_close(p1 - p0, -lr * (1 + mu) * mean, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------- the servicer's limits, for a joined caller
# (docs/security.md, "Hostile clients"): a caller with a valid session gets past the
# authentication, so these reach the stream slots, the Push deadlines and the chunk bounds.


class WarningLines(logging.Handler):
    """The coordinator's warning lines while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def wait_for(self, text: str, count: int = 1) -> None:
        """Until ``count`` lines hold ``text`` (a call's end reaches the caller before the
        coordinator logs why)."""
        wait_until(lambda: sum(text in x for x in self.lines) >= count, RPC_TIMEOUT_S, repr(text))
        assert sum(text in x for x in self.lines) == count, self.lines


@pytest.fixture
def warnings_logged() -> Iterator[WarningLines]:
    handler = WarningLines()
    logger = logging.getLogger("geoloco.coordinator")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def held_push(w: RawWorker, release: threading.Event, *first: pb.PushChunk) -> grpc.Future:
    """A Push of ``w`` that sends ``first`` and then nothing until ``release``."""
    def messages() -> Iterator[pb.PushChunk]:
        yield from first
        release.wait(RPC_TIMEOUT_S)

    return w.stub.Push.future(messages(), timeout=RPC_TIMEOUT_S, metadata=wire.caller_metadata(w.id, w.session))


def ended(calls: list[grpc.Future]) -> list[str]:
    """Each call's status code, once every one has ended."""
    for call in calls:
        call.exception(timeout=RPC_TIMEOUT_S)
    return [call.code().name for call in calls]


def test_a_joined_worker_gets_its_stream_slots_and_an_idle_push_is_cut_at_the_deadline(
        tmp_path, workers, monkeypatch, warnings_logged):
    monkeypatch.setattr(limits, "FIRST_MESSAGE_S", 1.0)
    cfg = make_config()
    release = threading.Event()
    try:
        with running(cfg, tmp_path / "run") as coordinator:
            a, _ = joined(coordinator, workers, 2)
            # one more than the slots: whichever comes last is refused at once, whatever the order
            calls = [held_push(a, release) for _ in range(limits.STREAMS_PER_WORKER + 1)]
            codes = ended(calls)
            assert sorted(codes) == ["CANCELLED"] * limits.STREAMS_PER_WORKER + ["RESOURCE_EXHAUSTED"]
            refused = calls[codes.index("RESOURCE_EXHAUSTED")]
            assert f"already has {limits.STREAMS_PER_WORKER} Push calls open" in refused.details()
            warnings_logged.wait_for("no PushHeader within the first-message deadline",
                                     limits.STREAMS_PER_WORKER)
            # the slots came back, and nothing of the cut calls is in round 0
            assert a.push(0, sparse_frame(cfg, coordinator.layout, a.id, 0)).accepted
    finally:
        release.set()


def test_a_push_that_stops_sending_is_cut_at_the_idle_deadline(tmp_path, workers, monkeypatch,
                                                               warnings_logged):
    monkeypatch.setattr(limits, "IDLE_MESSAGE_S", 1.0)
    cfg = make_config()
    release = threading.Event()
    try:
        with running(cfg, tmp_path / "run") as coordinator:
            a, _ = joined(coordinator, workers, 2)
            frame = sparse_frame(cfg, coordinator.layout, a.id, 0)
            header = pb.PushHeader(worker_id=a.id, session=a.session, round=0, total_bytes=len(frame))
            call = held_push(a, release, pb.PushChunk(header=header), pb.PushChunk(data=frame[:100]))
            assert ended([call]) == ["CANCELLED"]
            warnings_logged.wait_for(f"stream broke after 100 of {len(frame)} bytes (no data within "
                                     "the idle deadline")
            assert a.push(0, frame).accepted
    finally:
        release.set()


def pushed(w: RawWorker, header: pb.PushHeader, *parts: pb.PushChunk) -> pb.PushReply:
    return w.stub.Push(iter([pb.PushChunk(header=header), *parts]), timeout=RPC_TIMEOUT_S,
                       metadata=wire.caller_metadata(w.id, w.session))


def test_chunk_bounds_refuse_a_joined_workers_push_and_change_nothing(tmp_path, workers):
    cfg = make_config()
    with running(cfg, tmp_path / "run") as coordinator:
        a, _ = joined(coordinator, workers, 2)
        frame = sparse_frame(cfg, coordinator.layout, a.id, 0)
        largest = coordinator.layout.numel * 4 + service.FRAME_OVERHEAD_BYTES
        for total in (0, largest + 1):
            rejected(a.push(0, frame, total_bytes=total), f"total_bytes {total} is outside 1..{largest}")
        rejected(a.push(0, frame, total_bytes=len(frame) - 1), f"longer than its total_bytes {len(frame) - 1}")

        def header() -> pb.PushHeader:
            return pb.PushHeader(worker_id=a.id, session=a.session, round=0, total_bytes=len(frame))

        most = -(-len(frame) // wire.CHUNK_BYTES) + service.EXTRA_CHUNKS
        one_byte = [pb.PushChunk(data=frame[i:i + 1]) for i in range(most + 1)]
        rejected(pushed(a, header(), *one_byte), f"more than {most} chunks")
        rejected(pushed(a, header(), pb.PushChunk(data=b"")), "an empty data chunk")
        rejected(pushed(a, header(), pb.PushChunk(data=frame[:10]), pb.PushChunk(header=header())),
                 "a second PushHeader")
        assert a.push(0, frame).accepted  # none of the above took a's place in round 0
