"""The worker side of the round protocol (docs/protocol.md): join with retry, fetch state,
follow the Rounds stream, train, push frames, apply round results and check digests,
rejoin with the same id when the connection or the coordinator comes back.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from torch import Tensor

from geoloco import transport
from geoloco.compression import (
    Compressor,
    Frame,
    FrameError,
    Layout,
    decode_frame,
    encode_dense,
    on_huge_pages,
)
from geoloco.config import RunConfig, validate
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.replica import apply_round, param_digest
from geoloco.tasks import build_task
from geoloco.transport import CoordinatorUnreachable, JoinRefused
from geoloco.worker.trainer import InnerTrainer, describe_device, resolve_device

log = logging.getLogger(__name__)

RETRYABLE = transport.RETRYABLE
WARMUP_SIDE = 256  # the stand-in model of the codec warm-up: one 256 x 256 matrix, one vector


class Disconnected(Exception):
    """The Rounds stream broke or a call failed with UNAVAILABLE: rejoin and resync."""


@dataclass
class RoundResult:
    """One closed round as broadcast by the coordinator. It is queued as soon as its header
    is in; its frames follow, each decoded as soon as its bytes are in, and then the digest
    the coordinator sends once it has applied the round itself."""

    header: pb.RoundHeader
    frames: queue.Queue[Frame | Exception] = field(default_factory=queue.Queue)
    nbytes: int = 0  # frame bytes received so far
    complete_at: float | None = None  # monotonic time the last frame byte was in
    digest: Future[str] = field(default_factory=Future)  # Disconnected if it never comes

    def decoded_frames(self) -> Iterator[Frame]:
        """The header's frames in order, each as soon as it is decoded; FrameError for a
        frame that does not decode, Disconnected when the stream broke first."""
        for _ in self.header.frames:
            item = self.frames.get()
            if isinstance(item, Exception):
                raise item
            yield item


@dataclass
class WorkerOptions:
    """What the worker process decides locally (the run config comes from the coordinator)."""

    address: str
    token: str
    device: str = "auto"
    connect_timeout_s: float = 60.0
    report_dir: Path | None = None  # writes worker-<id>.json (join, then final digest)
    max_resyncs: int = 50  # give up if the replica keeps diverging
    identity_file: Path | None = None  # {worker_id, session} from an earlier Join to reclaim


def read_identity(path: Path) -> tuple[int, str]:
    """The worker id and session that an earlier Join assigned (the container entrypoint
    joins as root to shape the link, then the worker reclaims that identity)."""
    try:
        data = json.loads(Path(path).read_text())
        return int(data["worker_id"]), str(data["session"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"identity file {str(path)!r} is unreadable or lacks worker_id/session: {exc}") from None


class RoundsFollower:
    """Background thread reading the Rounds stream: queues a RoundResult as soon as its
    header is in, decodes each of its frames as soon as the frame's bytes are in, fills in
    its digest when that arrives, and queues a Disconnected marker when the stream ends or
    breaks."""

    def __init__(self, stub: pb_grpc.CoordinatorStub, request: pb.RoundsRequest, layout: Layout) -> None:
        self.results: queue.Queue[RoundResult | Disconnected] = queue.Queue()
        self.open_round = -1
        self.layout = layout
        self._pending: RoundResult | None = None  # its frames or digest still to come
        self._call = stub.Rounds(request)
        self._thread = threading.Thread(target=self._run, name="rounds-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._read(iter(self._call))
            reason = "the coordinator closed the Rounds stream"
        except grpc.RpcError as exc:
            reason = f"Rounds stream broke: {exc.code().name} {exc.details()}"
        except ValueError as exc:
            reason = f"Rounds stream is malformed: {exc}"
        except Exception as exc:  # noqa: BLE001 - the main thread must not wait forever
            log.exception("the Rounds stream reader failed")
            reason = f"Rounds stream reader failed: {exc!r}"
        pending = self._pending
        if pending is not None:  # whoever waits for its frames or digest learns it ended
            gone = Disconnected(f"round {pending.header.round} result cut off: {reason}")
            pending.frames.put(gone)
            pending.digest.set_exception(gone)
        self.results.put(Disconnected(reason))

    def _read(self, updates: Iterator[pb.RoundUpdate]) -> None:
        for update in updates:
            kind = update.WhichOneof("part")
            if kind == "keepalive":
                self.open_round = update.keepalive.round
            elif kind == "header":
                if self._pending is not None:
                    raise ValueError(f"round {update.header.round} began before the digest of "
                                     f"round {self._pending.header.round}")
                self._pending = RoundResult(update.header)
                self.results.put(self._pending)
                self._collect(self._pending, updates)
            elif kind == "digest":
                self._take_digest(update.digest)
            else:
                raise ValueError("frame data without a round header")

    def _take_digest(self, msg: pb.RoundDigest) -> None:
        result = self._pending
        if result is None or msg.round != result.header.round:
            raise ValueError(f"digest for round {msg.round} without its round result")
        self._pending = None
        result.digest.set_result(msg.digest)

    def _collect(self, result: RoundResult, updates: Iterator[pb.RoundUpdate]) -> None:
        """Read the frames' bytes, decoding each frame as soon as it is complete (only the
        last decode waits for the link); a frame that does not decode is passed on as its
        FrameError, and the rest of the bytes are still read."""
        header, data, failed = result.header, bytearray(), False
        for i, info in enumerate(header.frames):
            while len(data) < info.nbytes:
                update = next(updates, None)
                if update is None or update.WhichOneof("part") != "data":
                    raise ValueError(f"round {header.round}: frame data ended early, before the "
                                     f"{info.nbytes} bytes of the frame from worker {info.sender}")
                data += update.data
            frame_bytes = bytes(data[: info.nbytes])
            del data[: info.nbytes]
            if i == len(header.frames) - 1 and data:
                raise ValueError(f"round {header.round}: {len(data)} frame bytes more than the header says")
            result.nbytes += len(frame_bytes)  # set before the frame is handed over
            if i == len(header.frames) - 1:
                result.complete_at = time.monotonic()
            if not failed:
                try:
                    result.frames.put(decode_frame(frame_bytes, self.layout))
                except ValueError as exc:  # FrameError: the codec names what is wrong
                    failed = True
                    result.frames.put(FrameError(f"frame from worker {info.sender}: {exc}"))
        if not header.frames:
            result.complete_at = time.monotonic()

    def next_result(self, timeout: float | None = None) -> RoundResult | Disconnected | None:
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5.0)


class DigestCheck:
    """Compares ``param_digest(theta)`` with the coordinator's digest of a round on a
    background thread, so the hash runs beside the next inner loop instead of before it.
    ``theta`` must not change until ``outcome()`` or ``release()`` has returned."""

    def __init__(self, header: pb.RoundHeader, theta: list[Tensor], expected: Future[str]) -> None:
        self.header = header
        self.expected = expected
        self.mine: str | None = None
        self._thread = threading.Thread(target=self._hash, args=(theta,),
                                        name=f"digest-check-{header.round}", daemon=True)
        self._thread.start()

    def _hash(self, theta: list[Tensor]) -> None:
        self.mine = param_digest(theta)

    def outcome(self) -> bool:
        """True when the digests match, False on a mismatch; raises Disconnected when the
        Rounds stream ended before the coordinator's digest came."""
        self._thread.join()
        return self.mine == self.expected.result()

    def release(self) -> bool:
        """Wait only for the hash (θ is free again): True if the coordinator's digest is
        already here and matches, False if it differs or is not known."""
        self._thread.join()
        if not self.expected.done() or self.expected.exception() is not None:
            return False
        return self.mine == self.expected.result()


class WorkerClient:
    """One worker's life: join, fetch state, then one round after the other until finished."""

    def __init__(self, options: WorkerOptions) -> None:
        self.opt = options
        self.device = resolve_device(options.device)
        self.channel: grpc.Channel | None = None
        self.stub: pb_grpc.CoordinatorStub | None = None
        self.follower: RoundsFollower | None = None
        self.worker_id: int | None = None
        self.session = ""
        self.cfg: RunConfig | None = None
        self.round = -1  # the round whose start parameters ``theta`` holds
        self.task: pb.WorkerTask | None = None
        self.frame: bytes | None = None  # this worker's frame for ``self.round``, once computed
        self.push_info = PushInfo()
        self.pushed_round = -1
        self.check: DigestCheck | None = None  # of θ, while it runs beside the inner loop
        self.apply_s = 0.0  # how long applying the last round result took (reported in Push)
        # partition -> its latest pseudo-gradient (CPU fp32): s + 1 model-sized buffers
        # under gradient coding, the coded message is combined from them each round
        self.latest: dict[int, list[Tensor]] = {}
        self.stats = {"resyncs": 0, "rejected_pushes": 0, "reconnects": 0, "bytes_pushed": 0,
                      "bytes_received": 0, "rounds_applied": 0}
        if options.identity_file is not None:
            self.worker_id, self.session = read_identity(options.identity_file)

    # ------------------------------------------------------------------ connection

    def _join_request(self) -> pb.JoinRequest:
        caps = pb.Capabilities(
            device=describe_device(self.device), hostname=socket.gethostname(),
            version=_package_version(), threads=torch.get_num_threads(),
        )
        request = pb.JoinRequest(token=self.opt.token, capabilities=caps)
        if self.worker_id is not None:
            request.reclaim_worker_id = self.worker_id
            request.reclaim_session = self.session
        return request

    def join(self) -> pb.JoinReply:
        """Join (or reclaim), retrying with exponential backoff until connect_timeout_s."""
        def call(channel: grpc.Channel) -> pb.JoinReply:
            return pb_grpc.CoordinatorStub(channel).Join(self._join_request(),
                                                         timeout=transport.JOIN_CALL_TIMEOUT_S)

        reply, channel = transport.join_with_backoff(self.opt.address, call, self.opt.connect_timeout_s)
        if self.channel is not None:
            self.channel.close()
        self.channel, self.stub = channel, pb_grpc.CoordinatorStub(channel)
        self._accept(reply)
        return reply

    def _accept(self, reply: pb.JoinReply) -> None:
        reclaimed = self.worker_id is not None
        self.worker_id, self.session = reply.worker_id, reply.session
        log.info("%s as worker %d at %s (open round %d, device %s, straggler profile %r)",
                 "rejoined" if reclaimed else "joined", reply.worker_id, self.opt.address,
                 reply.current_round, describe_device(self.device), reply.straggler_profile or "none")
        self._write_report("rejoined" if reclaimed else "joined")
        if self.cfg is None:
            self._setup(reply)

    def _setup(self, reply: pb.JoinReply) -> None:
        """Build the task, model replica, trainer and codec from the run config."""
        self.cfg = validate(RunConfig.from_dict(json.loads(reply.run_config_json)))
        self.task_data = build_task(self.cfg.task, self.cfg.workers, seed=self.cfg.seed)
        self.trainer = InnerTrainer(self.task_data, self.cfg.inner, self.cfg.rounds, self.device)
        self.layout = Layout.from_named_tensors(self.trainer.model.named_parameters())
        if reply.layout_digest and reply.layout_digest != self.layout.digest:
            raise JoinRefused(
                f"layout mismatch: coordinator {reply.layout_digest.hex()} vs this worker "
                f"{self.layout.digest.hex()}; run the same geoloco version on both sides"
            )
        # the replica on huge pages: applying sparse rounds touches cache lines at random
        self.theta = on_huge_pages([p.detach().to("cpu", torch.float32) for p in self.trainer.params])
        self.compressor = self._make_compressor(self.layout)
        self.straggler = _make_straggler(reply.straggler_profile, reply.worker_id, self.cfg.seed)
        if self.compressor is not None:
            self._warm_codec()

    def _make_compressor(self, layout: Layout) -> Compressor | None:
        comp = self.cfg.compression
        if comp.method != "sparseloco":
            return None
        return Compressor(layout, density=comp.density, beta=comp.ef_beta, tile=comp.tile,
                          index_coding=comp.index_coding, zstd=comp.zstd)

    def _warm_codec(self) -> None:
        """Compress, decode and apply a small stand-in model once, so the codec's compiled
        kernels are ready (numba compiles or loads them on first use, up to seconds) before
        the first rounds rather than inside them."""
        start = time.monotonic()
        layout = Layout.from_named_tensors([("w", torch.zeros(WARMUP_SIDE, WARMUP_SIDE)),
                                            ("b", torch.zeros(WARMUP_SIDE))])
        gen = torch.Generator().manual_seed(0)
        deltas = [torch.randn(s.shape, generator=gen) for s in layout.specs]
        frame = decode_frame(self._make_compressor(layout).compress(deltas, round=0, sender=0), layout)
        params = [torch.zeros(s.shape) for s in layout.specs]
        apply_round(params, [frame, frame], [0.5, 0.5], "sum", -1.0)
        log.info("codec kernels ready in %.2fs", time.monotonic() - start)

    def fetch_state(self) -> None:
        """Replace θ with the coordinator's parameters and take the task of the open round."""
        data, first = bytearray(), None
        try:
            for chunk in self.stub.FetchState(pb.FetchStateRequest(worker_id=self.worker_id, session=self.session)):
                first = first or chunk
                data += chunk.data
        except grpc.RpcError as exc:
            raise _rpc_failure("FetchState", exc) from None
        if first is None or len(data) != first.total_bytes:
            raise Disconnected(f"FetchState ended after {len(data)} bytes")
        self._load_state(first, bytes(data))

    def _load_state(self, first: pb.StateChunk, data: bytes) -> None:
        self._release_check()
        tensors = _dense_tensors(decode_frame(data, self.layout))
        for t, v in zip(self.theta, tensors, strict=True):
            t.copy_(v.reshape(t.shape))
        digest = param_digest(self.theta)
        if digest != first.digest:
            raise RuntimeError(f"state for round {first.round} has digest {digest}, coordinator says {first.digest}")
        self.round, self.task = first.round, first.task
        self.frame, self.pushed_round, self.apply_s = None, -1, 0.0
        self.stats["bytes_received"] += len(data)
        log.info("fetched state of round %d (%d bytes, digest %s)", first.round, len(data), digest[:16])

    def _follow(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        request = pb.RoundsRequest(worker_id=self.worker_id, session=self.session, from_round=self.round)
        self.follower = RoundsFollower(self.stub, request, self.layout)

    def connect(self) -> None:
        reply = self.join()
        if not self._release_check():
            self.task = None  # θ was never confirmed: fetch the state
        if reply.current_round != self.round or self.task is None:
            self.fetch_state()
        self._follow()

    def reconnect(self, reason: str) -> None:
        """Rejoin with the same id (fetching state if the coordinator's round is not ours),
        retrying until connect_timeout_s; Join itself backs off while unreachable."""
        log.warning("connection lost (%s); rejoining as worker %s", reason, self.worker_id)
        self.stats["reconnects"] += 1
        deadline = time.monotonic() + self.opt.connect_timeout_s
        while True:
            if self.follower is not None:
                self.follower.stop()
                self.follower = None
            self.pushed_round = -1
            try:
                self.connect()
                return
            except Disconnected as exc:
                if time.monotonic() > deadline:
                    raise CoordinatorUnreachable(f"could not resume with {self.opt.address}: {exc}") from None
                log.warning("rejoin incomplete (%s); retrying in %.1fs", exc, transport.BACKOFF_START_S)
                time.sleep(transport.BACKOFF_START_S)

    # ------------------------------------------------------------------ rounds

    def run(self) -> int:
        """The worker's main loop; returns the process exit code."""
        try:
            self.connect()
        except Disconnected as exc:
            self.reconnect(str(exc))
        while True:
            try:
                result = self._round_step()
                if result is not None and self._apply(result):
                    break
            except Disconnected as exc:
                self.reconnect(str(exc))
        self._finish()
        return 0

    def _round_step(self) -> RoundResult | None:
        """Compute and push this round's frame unless the round already closed, then wait
        for the next round result (None: nothing yet)."""
        ready = self._poll(0.0)
        if ready is not None:
            return ready
        if self.frame is None and self._has_work():
            if not self._compute():
                return None  # θ failed its digest check and was fetched again
            ready = self._poll(0.0)
            if ready is not None:
                return ready
        if self.frame is not None and self.pushed_round != self.round:
            self._push()
        return self._poll(transport.KEEPALIVE_S)

    def _poll(self, timeout: float) -> RoundResult | None:
        """The next round result, skipping rounds already applied."""
        while True:
            item = self.follower.next_result(timeout)
            if isinstance(item, Disconnected):
                raise item
            if item is None or item.header.round >= self.round:
                return item

    def _has_work(self) -> bool:
        return self.task is not None and bool(self.task.train_partitions or self.task.send_partitions)

    def _compute(self) -> bool:
        """Train, confirm θ's digest (checked meanwhile on a thread), then compress. False
        when θ was not the coordinator's: the state was fetched again and nothing is sent."""
        task, start, losses = self.task, time.monotonic(), []
        trained = self._partitions_to_train(task)
        for p in trained:
            self.latest[p], loss = self.trainer.train_partition(self.theta, p, self.round)
            losses.append(loss)
        compute_s = time.monotonic() - start
        if not self._confirm():
            return False
        message = self._combine(task)
        delay = self.straggler.extra_delay(self.round, compute_s) if self.straggler else 0.0
        if delay > 0:
            log.info("round %d: straggler emulation sleeps %.2fs", self.round, delay)
            time.sleep(delay)
        encode_start = time.monotonic()
        self.frame = self._encode(message)
        encode_s = time.monotonic() - encode_start
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        self.push_info = PushInfo(compute_s, mean_loss, trained, encode_s, self.apply_s)
        log.info("round %d: trained partitions %s in %.2fs, loss %.4f, frame %d bytes "
                 "(encoded in %.2fs)", self.round, trained, compute_s, mean_loss, len(self.frame),
                 encode_s)
        return True

    def _partitions_to_train(self, task: pb.WorkerTask) -> list[int]:
        """The task's partitions, plus any partition it sends that this process never
        trained (a pipelined worker restarted mid-run warms up like round 0)."""
        trained = list(task.train_partitions)
        missing = [p for p in task.send_partitions if p not in self.latest and p not in trained]
        if missing:
            log.info("round %d: no buffer yet for partitions %s; training them too", self.round, missing)
        return trained + missing

    def _combine(self, task: pb.WorkerTask) -> list[Tensor]:
        """m = Σ_j c_j · latest[p_j] (a plain copy of Δ without gradient coding)."""
        sends = list(task.send_partitions) or list(task.train_partitions)
        coeffs = list(task.send_coefficients) or [1.0] * len(sends)
        missing = [p for p in sends if p not in self.latest]
        if missing:
            raise RuntimeError(f"round {self.round}: asked to send partitions {missing} never trained")
        if len(sends) == 1 and coeffs[0] == 1.0:
            return self.latest[sends[0]]
        out = [torch.zeros_like(t) for t in self.latest[sends[0]]]
        for p, c in zip(sends, coeffs, strict=True):
            for o, d in zip(out, self.latest[p], strict=True):
                o.add_(d, alpha=c)
        return out

    def _encode(self, message: list[Tensor]) -> bytes:
        if self.compressor is not None:
            return self.compressor.compress(message, round=self.round, sender=self.worker_id)
        comp = self.cfg.compression
        return encode_dense(self.layout, message, round=self.round, sender=self.worker_id,
                            dtype=comp.dense_dtype, zstd=comp.zstd)

    def _push(self) -> None:
        info = self.push_info
        header = pb.PushHeader(worker_id=self.worker_id, session=self.session, round=self.round,
                               total_bytes=len(self.frame), compute_seconds=info.compute_s,
                               train_loss=info.loss, partitions=info.partitions,
                               encode_seconds=info.encode_s, apply_seconds=info.apply_s)
        chunks = [pb.PushChunk(header=header)] + [pb.PushChunk(data=c) for c in transport.chunks(self.frame)]
        try:
            reply = self.stub.Push(iter(chunks))
        except grpc.RpcError as exc:
            raise _rpc_failure("Push", exc) from None
        self.pushed_round = self.round
        if reply.accepted:
            self.stats["bytes_pushed"] += len(self.frame)
        else:
            self.stats["rejected_pushes"] += 1
            log.warning("round %d: coordinator rejected the frame: %s", self.round, reply.reason)

    def _apply(self, result: RoundResult) -> bool:
        """Apply a round result to θ, each frame as it arrives, and start checking the
        digest; True when the run is finished."""
        header = result.header
        if not self._confirm():
            return False  # θ was fetched again: it already holds this result
        if header.round > self.round:
            log.warning("round %d result arrived while at round %d; fetching state", header.round, self.round)
            return self._resync(header)
        self.task = None  # θ is between rounds until every frame is in
        start = time.monotonic()
        if not self._apply_frames(result):
            return self._resync(header)
        self.apply_s = time.monotonic() - max(start, result.complete_at or start)
        self.stats["bytes_received"] += result.nbytes
        self.stats["rounds_applied"] += 1
        self._log_round(header)
        self.round, self.task = header.round + 1, header.next_task
        self.frame = None
        self.check = DigestCheck(header, self.theta, result.digest)
        if header.finished:
            self._confirm()
        return header.finished

    def _apply_frames(self, result: RoundResult) -> bool:
        """θ += the round's update, frame by frame as they are decoded; False when a frame
        does not decode (θ is then partly updated: the caller resyncs)."""
        header = result.header
        try:
            apply_round(self.theta, result.decoded_frames(), [f.weight for f in header.frames],
                        header.aggregation or "sum", header.alpha)
        except FrameError as exc:
            log.error("round %d: bad frame in the round result (%s)", header.round, exc)
            return False
        return True

    def _confirm(self) -> bool:
        """Wait for the digest check of θ (if one runs). On a mismatch fetch the state again
        and return False; a Rounds stream that ended before the digest raises Disconnected,
        and the reconnect fetches the state."""
        check, self.check = self.check, None
        if check is None:
            return True
        try:
            ok = check.outcome()
        except Disconnected:
            self.task = None  # θ is unconfirmed: a reconnect must fetch the state
            raise
        if not ok:
            log.warning("round %d: digest mismatch (mine %s, coordinator %s)", check.header.round,
                        check.mine[:16], check.expected.result()[:16])
            self._resync(check.header)
        return ok

    def _release_check(self) -> bool:
        """Before θ is replaced: stop checking it; True when it was confirmed (or nothing
        was pending)."""
        check, self.check = self.check, None
        return check is None or check.release()

    def _resync(self, header: pb.RoundHeader) -> bool:
        self.stats["resyncs"] += 1
        self.task = None  # θ is not the coordinator's: a reconnect must fetch the state
        if self.stats["resyncs"] > self.opt.max_resyncs:
            raise RuntimeError(f"{self.stats['resyncs']} resyncs: this replica keeps diverging from the coordinator")
        if header.finished:
            self._fetch_final(header)
            return True
        self.fetch_state()
        return False

    def _fetch_final(self, header: pb.RoundHeader) -> None:
        try:
            self.fetch_state()
        except (Disconnected, RuntimeError) as exc:
            log.error("run finished but the final state could not be fetched: %s", exc)
        self.round = header.round + 1

    def _log_round(self, header: pb.RoundHeader) -> None:
        log.info("round %d applied: %d frames from %s in %.2fs", header.round, len(header.frames),
                 list(header.arrived), self.apply_s)

    def _finish(self) -> None:
        digest = param_digest(self.theta)
        log.info("run finished after round %d: final digest %s, %d resyncs, %d reconnects",
                 self.round - 1, digest, self.stats["resyncs"], self.stats["reconnects"])
        self._write_report("finished", digest=digest)
        self.close()

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()
            self.follower = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _write_report(self, status: str, digest: str | None = None) -> None:
        """worker-<id>.json in the report folder: id, pid, status, digest, counters."""
        if self.opt.report_dir is None or self.worker_id is None:
            return
        report = {"worker_id": self.worker_id, "pid": os.getpid(), "status": status,
                  "device": describe_device(self.device), "round": self.round, "digest": digest,
                  **self.stats}
        path = Path(self.opt.report_dir) / f"worker-{self.worker_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(path)


@dataclass
class PushInfo:
    """What a push reports beside the frame (PushHeader)."""

    compute_s: float = 0.0
    loss: float = float("nan")
    partitions: list[int] = field(default_factory=list)
    encode_s: float = 0.0
    apply_s: float = 0.0  # applying the previous round result, before this round's compute


def _rpc_failure(call: str, exc: grpc.RpcError) -> Exception:
    """UNAVAILABLE (and friends) → Disconnected (rejoin); anything else is fatal."""
    if exc.code() in RETRYABLE or exc.code() == grpc.StatusCode.CANCELLED:
        return Disconnected(f"{call} failed: {exc.code().name} {exc.details()}")
    return RuntimeError(f"{call} failed: {exc.code().name}: {exc.details()}")


def _dense_tensors(frame) -> list[Tensor]:
    """The tensors of a dense frame on CPU (``Frame.to_dense`` may return a list or a dict)."""
    dense = frame.to_dense(torch.device("cpu"))
    return list(dense.values()) if isinstance(dense, dict) else list(dense)


def _make_straggler(profile: str, worker_id: int, seed: int):
    """The straggler model from worker.stragglers, or None without one (or for 'none')."""
    if not profile or profile == "none":
        return None
    try:
        from geoloco.worker.stragglers import make_straggler
    except ImportError:
        log.warning("straggler profile %r ignored: worker.stragglers is not available", profile)
        return None
    return make_straggler(profile, worker_id, seed)


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("geoloco")
    except Exception:  # noqa: BLE001 - a missing dist-info only blanks the field
        return "unknown"
