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
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from torch import Tensor

from compression import Compressor, Layout, apply_frames, decode_frame, encode_dense
from geoloco import wire
from geoloco.config import RunConfig, validate
from geoloco.state import param_digest
from geoloco.tasks import build_task
from protos import geoloco_pb2 as pb
from protos import geoloco_pb2_grpc as pb_grpc
from worker.trainer import InnerTrainer, describe_device, resolve_device

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.5  # first retry delay; doubles up to BACKOFF_MAX_S (docs/protocol.md step 1)
BACKOFF_MAX_S = 10.0
JOIN_CALL_TIMEOUT_S = 10.0  # one Join attempt; a dead address fails much faster
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class CoordinatorUnreachable(RuntimeError):
    """Join kept failing for longer than worker.connect_timeout_s."""


class JoinRefused(RuntimeError):
    """The coordinator answered Join with an error (wrong token, unknown reclaim, run over)."""


class Disconnected(Exception):
    """The Rounds stream broke or a call failed with UNAVAILABLE: rejoin and resync."""


@dataclass
class RoundResult:
    """One closed round as broadcast by the coordinator: its header and the frames' bytes."""

    header: pb.RoundHeader
    frames: list[bytes] = field(default_factory=list)


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
    """Background thread reading the Rounds stream into a queue of RoundResult, and a
    Disconnected marker when the stream ends or breaks."""

    def __init__(self, stub: pb_grpc.CoordinatorStub, request: pb.RoundsRequest) -> None:
        self.results: queue.Queue[RoundResult | Disconnected] = queue.Queue()
        self.open_round = -1
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
        self.results.put(Disconnected(reason))

    def _read(self, updates: Iterator[pb.RoundUpdate]) -> None:
        for update in updates:
            kind = update.WhichOneof("part")
            if kind == "keepalive":
                self.open_round = update.keepalive.round
            elif kind == "header":
                self.results.put(self._collect(update.header, updates))
            else:
                raise ValueError("frame data without a round header")

    @staticmethod
    def _collect(header: pb.RoundHeader, updates: Iterator[pb.RoundUpdate]) -> RoundResult:
        need = sum(f.nbytes for f in header.frames)
        data = bytearray()
        while len(data) < need:
            update = next(updates)
            if update.WhichOneof("part") != "data":
                raise ValueError(f"round {header.round}: {len(data)} of {need} frame bytes before the next message")
            data += update.data
        if len(data) != need:
            raise ValueError(f"round {header.round}: {len(data)} frame bytes, header says {need}")
        frames, start = [], 0
        for info in header.frames:
            frames.append(bytes(data[start : start + info.nbytes]))
            start += info.nbytes
        return RoundResult(header, frames)

    def next_result(self, timeout: float | None = None) -> RoundResult | Disconnected | None:
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5.0)


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
        self.push_info: tuple[float, float, list[int]] = (0.0, 0.0, [])
        self.pushed_round = -1
        # partition -> its latest pseudo-gradient (CPU fp32): s + 1 model-sized buffers
        # under gradient coding, the coded message is combined from them each round
        self.latest: dict[int, list[Tensor]] = {}
        self.stats = {"resyncs": 0, "rejected_pushes": 0, "reconnects": 0, "bytes_pushed": 0,
                      "bytes_received": 0, "rounds_applied": 0}
        if options.identity_file is not None:
            self.worker_id, self.session = read_identity(options.identity_file)

    # ------------------------------------------------------------------ connection

    def _open_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = grpc.insecure_channel(self.opt.address, options=wire.CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

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
        start, delay, attempt = time.monotonic(), BACKOFF_START_S, 0
        while True:
            attempt += 1
            self._open_channel()
            try:
                reply = self.stub.Join(self._join_request(), timeout=JOIN_CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise JoinRefused(f"coordinator at {self.opt.address} refused Join: "
                                      f"{exc.code().name}: {exc.details()}") from None
                delay = self._wait_retry(start, delay, attempt, exc)
                continue
            self._accept(reply)
            return reply

    def _wait_retry(self, start: float, delay: float, attempt: int, exc: grpc.RpcError) -> float:
        elapsed = time.monotonic() - start
        left = self.opt.connect_timeout_s - elapsed
        if left <= 0:
            raise CoordinatorUnreachable(
                f"coordinator at {self.opt.address} unreachable after {attempt} attempts in "
                f"{elapsed:.1f}s (worker.connect_timeout_s={self.opt.connect_timeout_s:g}); "
                "check the address and that the coordinator is running"
            )
        wait = min(delay, left)
        log.warning("join attempt %d to %s failed (%s); retrying in %.1fs",
                    attempt, self.opt.address, exc.code().name, wait)
        time.sleep(wait)
        return min(delay * 2, BACKOFF_MAX_S)

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
        self.theta = [p.detach().to("cpu", torch.float32).clone() for p in self.trainer.params]
        self.compressor = self._make_compressor()
        self.straggler = _make_straggler(reply.straggler_profile, reply.worker_id, self.cfg.seed)

    def _make_compressor(self) -> Compressor | None:
        comp = self.cfg.compression
        if comp.method != "sparseloco":
            return None
        return Compressor(self.layout, density=comp.density, beta=comp.ef_beta, tile=comp.tile,
                          index_coding=comp.index_coding, zstd=comp.zstd)

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
        tensors = _dense_tensors(decode_frame(data, self.layout))
        for t, v in zip(self.theta, tensors, strict=True):
            t.copy_(v.reshape(t.shape))
        digest = param_digest(self.theta)
        if digest != first.digest:
            raise RuntimeError(f"state for round {first.round} has digest {digest}, coordinator says {first.digest}")
        self.round, self.task = first.round, first.task
        self.frame, self.pushed_round = None, -1
        self.stats["bytes_received"] += len(data)
        log.info("fetched state of round %d (%d bytes, digest %s)", first.round, len(data), digest[:16])

    def _follow(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        request = pb.RoundsRequest(worker_id=self.worker_id, session=self.session, from_round=self.round)
        self.follower = RoundsFollower(self.stub, request)

    def connect(self) -> None:
        reply = self.join()
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
                log.warning("rejoin incomplete (%s); retrying in %.1fs", exc, BACKOFF_START_S)
                time.sleep(BACKOFF_START_S)

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
            self._compute()
            ready = self._poll(0.0)
            if ready is not None:
                return ready
        if self.frame is not None and self.pushed_round != self.round:
            self._push()
        return self._poll(wire.KEEPALIVE_S)

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

    def _compute(self) -> None:
        task, start, losses = self.task, time.monotonic(), []
        trained = self._partitions_to_train(task)
        for p in trained:
            self.latest[p], loss = self.trainer.train_partition(self.theta, p, self.round)
            losses.append(loss)
        compute_s = time.monotonic() - start
        message = self._combine(task)
        delay = self.straggler.extra_delay(self.round, compute_s) if self.straggler else 0.0
        if delay > 0:
            log.info("round %d: straggler emulation sleeps %.2fs", self.round, delay)
            time.sleep(delay)
        self.frame = self._encode(message)
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        self.push_info = (compute_s, mean_loss, trained)
        log.info("round %d: trained partitions %s in %.2fs, loss %.4f, frame %d bytes",
                 self.round, trained, compute_s, mean_loss, len(self.frame))

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
        compute_s, loss, partitions = self.push_info
        header = pb.PushHeader(worker_id=self.worker_id, session=self.session, round=self.round,
                               total_bytes=len(self.frame), compute_seconds=compute_s,
                               train_loss=loss, partitions=partitions)
        chunks = [pb.PushChunk(header=header)] + [pb.PushChunk(data=c) for c in wire.chunks(self.frame)]
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
        """Apply a round result to θ; True when the run is finished."""
        header = result.header
        if header.round > self.round:
            log.warning("round %d result arrived while at round %d; fetching state", header.round, self.round)
            return self._resync(header)
        self.stats["bytes_received"] += sum(len(f) for f in result.frames)
        if not self._apply_frames(result):
            return self._resync(header)
        self.stats["rounds_applied"] += 1
        self._log_round(header)
        self.round, self.task = header.round + 1, header.next_task
        self.frame = None
        return header.finished

    def _apply_frames(self, result: RoundResult) -> bool:
        header = result.header
        try:
            frames = [decode_frame(data, self.layout) for data in result.frames]
        except ValueError as exc:
            log.error("round %d: bad frame in the round result (%s)", header.round, exc)
            return False
        weights = [f.weight for f in header.frames]
        if frames:
            apply_frames(self.theta, frames, weights, mode=header.aggregation or "sum", alpha=header.alpha)
        digest = param_digest(self.theta)
        if digest != header.digest:
            log.warning("round %d: digest mismatch (mine %s, coordinator %s)", header.round, digest[:16], header.digest[:16])
            return False
        return True

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
        log.info("round %d applied: %d frames from %s, val loss %.4f, digest %s ok",
                 header.round, len(header.frames), list(header.arrived), header.val_loss, header.digest[:16])

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
        from worker.stragglers import make_straggler
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
