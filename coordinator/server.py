"""The coordinator process: global parameters, worker registry and the round loop that
closes rounds, steps the outer optimizer, broadcasts the result and checkpoints; served
over gRPC with the health service (round protocol: docs/protocol.md)."""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections import deque
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from torch import Tensor

from geoloco import transport
from geoloco.compression import Layout, encode_dense, on_huge_pages
from geoloco.config import ConfigError, RunConfig
from geoloco.coordinator import checkpoint
from geoloco.coordinator.gradient_coding import GradientCode, make_code
from geoloco.coordinator.metrics import MetricsWriter, RoundMetrics, RunTotals, write_text_atomic
from geoloco.coordinator.outer import Update, apply_update, make_outer
from geoloco.coordinator.registry import WorkerRecord, WorkerRegistry
from geoloco.coordinator.rounds import Arrival, CodePolicy, Decision, RoundError, RoundState
from geoloco.coordinator.servicer import ClosedRound, CoordinatorServicer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc
from geoloco.replica import param_digest
from geoloco.tasks import build_task

log = logging.getLogger(__name__)

SERVICE_NAME = "geoloco.v1.Coordinator"
PORT_FILE = "coordinator.port"
CONFIG_FILE = "config.json"
HISTORY_ROUNDS = 8  # closed rounds kept for Rounds streams that reconnect behind
HISTORY_BYTES = 256 << 20  # ... and at most this many frame bytes of them (dense DiLoCo)
STOP_GRACE_S = 2.0  # in-flight calls get this long when the server stops
VAL_EVERY_ROUND_MAX_PARAMS = 20_000_000  # val_every None: larger models only at checkpoints/end
FRAME_OVERHEAD_BYTES = 64 * 1024  # headroom over a dense fp32 frame for headers and tables


class Coordinator:
    """Holds the global model and the round state; serves the wire on a gRPC server."""

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False) -> None:
        check_aggregation(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
        self.model = self.task.make_model().to("cpu", torch.float32)
        named = list(self.model.named_parameters())
        self.layout = Layout.from_named_tensors(named)
        # one buffer on huge pages: applying sparse rounds touches cache lines at random
        for (_, p), data in zip(named, on_huge_pages([p.data for _, p in named]), strict=True):
            p.data = data
        self.params: list[Tensor] = [p.data for _, p in named]
        self.code = make_code(cfg.coding.scheme, cfg.workers, cfg.coding.stragglers, cfg.coding.seed)
        self.policy = CodePolicy(self.code)
        self.outer = make_outer(cfg.compression.method, self.layout, cfg.outer)
        self.registry = WorkerRegistry(cfg.workers, cfg.coordinator.token)
        self.metrics = MetricsWriter(self.run_dir)
        self.totals = RunTotals()
        self.lock = threading.Condition()
        self.history: deque[ClosedRound] = deque(maxlen=HISTORY_ROUNDS)
        self.subscribers: dict[int, queue.Queue[ClosedRound | None]] = {}
        self.delivered_finish: set[int] = set()
        self.ready: set[int] = set()  # fetched the state or follow Rounds (this process)
        self.rejected = 0
        self.late = 0
        self.stopping = False
        self.failed = False
        self.done = threading.Event()
        self.max_frame_bytes = self.layout.numel * 4 + FRAME_OVERHEAD_BYTES
        self._state_cache: tuple[int, str, bytes] | None = None
        self._state_lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self._loop: threading.Thread | None = None
        self._started_at = time.monotonic()
        start_round = self._restore() if resume else 0
        self.totals.extra.update(coding_summary(self.code))
        self.rs = RoundState(start_round, cfg.coordinator.deadline_s)
        self.port: int | None = None

    # ----- lifecycle -----------------------------------------------------------------

    def start(self) -> int:
        """Bind, serve and start the round loop; returns the bound port."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.run_dir / CONFIG_FILE, self.cfg.to_json() + "\n")
        self._server = self._build_server()
        listen = self.cfg.coordinator.listen
        try:
            self.port = self._server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on coordinator.listen {listen!r} ({exc}); is another "
                          "coordinator running there? pick a free port, or port 0") from None
        self._server.start()
        write_text_atomic(self.run_dir / PORT_FILE, f"{self.port}\n")
        log.info("coordinator listening on %s (port %d), %d workers, %d rounds, model %s "
                 "(%d parameters)", self.cfg.coordinator.listen, self.port, self.cfg.workers,
                 self.cfg.rounds, self.cfg.task.model, self.layout.numel)
        log.info("gradient coding %s (n=%d, s=%d): worst-case decoding coefficient %.4g",
                 self.code.name, self.code.n, self.code.s, self.code.worst_case_coefficient)
        self._loop = threading.Thread(target=self._run, name="round-loop", daemon=True)
        self._loop.start()
        return self.port

    def wait(self, timeout: float | None = None) -> bool:
        """True once the run is over (all rounds done, or stopped)."""
        return self.done.wait(timeout)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop the round loop and the server (in-flight calls get ``grace`` seconds)."""
        with self.lock:
            self.stopping = True
            for sub in self.subscribers.values():
                sub.put(None)
            self.lock.notify_all()
        if self._loop is not None and self._loop is not threading.current_thread():
            self._loop.join(timeout=30)
        if self._server is not None:
            self._health.enter_graceful_shutdown()
            self._server.stop(grace).wait()
            self._server = None

    def _build_server(self) -> grpc.Server:
        threads = 3 * self.cfg.workers + 8  # Push + Rounds + FetchState per worker, health
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
            options=transport.SERVER_OPTIONS,
        )
        geoloco_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return server

    def _restore(self) -> int:
        ckpt = checkpoint.load_latest(self.run_dir)
        if ckpt is None:
            log.warning("--resume: no checkpoint in %s; starting from round 0", self.run_dir)
            return 0
        if ckpt.layout_digest != self.layout.digest:
            raise ValueError(
                f"checkpoint in {self.run_dir} was written for another model layout; "
                "resume with the same task.model and seq_len, or use a new run_dir"
            )
        with torch.no_grad():
            for name, p in zip(self._names(), self.params, strict=True):
                p.copy_(ckpt.params[name])
        self.outer.load_state_dict(ckpt.outer_state)
        self.registry.load_dict(ckpt.workers)
        self.totals = RunTotals(**ckpt.totals)
        log.info("resumed from checkpoint at round %d (digest %s)", ckpt.round, self.digest())
        return ckpt.round

    def _names(self) -> list[str]:
        return [spec.name for spec in self.layout.specs]

    def digest(self) -> str:
        return param_digest(self.params)

    # ----- the round loop ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._measure_initial()
            if self.rs.round >= self.cfg.rounds:
                log.info("all %d rounds were already done in %s", self.cfg.rounds, self.run_dir)
            elif self._wait_for_joins():
                while self.rs.round < self.cfg.rounds and not self.stopping:
                    self._run_round()
            if not self.stopping:
                self._finish_run()
        except Exception:  # noqa: BLE001 - the loop must report and end the run
            self.failed = True
            log.exception("coordinator round loop failed at round %d", self.rs.round)
        finally:
            self.done.set()

    def _measure_initial(self) -> None:
        if self.totals.initial_val_loss is None:
            self.totals.initial_val_loss = self.task.val_loss(self.model)
            log.info("initial validation loss %.4f", self.totals.initial_val_loss)

    def _wait_for_joins(self) -> bool:
        """Until all workers are ready, or join_timeout_s passed with at least one joined.
        Round 0 waits for every worker to have fetched the state (or to follow the Rounds
        stream) too, so that a slow starter does not lose round 0 to the deadline; a
        resumed run waits for the joins."""
        timeout = self.cfg.coordinator.join_timeout_s
        waited_since = time.monotonic()
        with self.lock:
            while not self.stopping and self._ready_count() < self.cfg.workers:
                if time.monotonic() - waited_since >= timeout:
                    if self.registry.live_count:
                        break
                    log.warning("no worker joined in %.0f s; still waiting", timeout)
                    waited_since = time.monotonic()
                self.lock.wait(timeout=0.5)
            if self.stopping:
                return False
            log.info("%d of %d workers joined (%d ready); opening round %d",
                     self.registry.live_count, self.cfg.workers, len(self.ready), self.rs.round)
            self.rs.open()
        return True

    def _ready_count(self) -> int:
        if self.rs.round > 0:
            return self.registry.live_count
        live = {i for i, r in self.registry.records.items() if r.live}
        return len(live & self.ready)

    def _run_round(self) -> None:
        """Close, broadcast at once, then apply and digest while the frames travel; the
        validation loss is measured last, off the workers' critical path."""
        decision = self._wait_for_close()
        if decision is None:
            return
        rs = self.rs
        update = self.outer.step(rs.round, rs.chosen(), decision)
        closed = self._describe(rs, update)
        with self._state_lock:  # FetchState sees the old round and params, or the new ones
            with self.lock:
                counts = self.rejected, self.late
                self.rejected = self.late = 0
                self._publish(closed)
            timing = RoundTiming(published_at=time.monotonic())
            self._apply(update, closed)
        timing.applied_at = time.monotonic()
        val = self.task.val_loss(self.model) if self._measure_val(rs.round + 1) else None
        self._record(rs, decision, closed, counts, timing, val)
        self._maybe_checkpoint(rs.round + 1)

    def _wait_for_close(self) -> Decision | None:
        with self.lock:
            while not self.stopping:
                decision = self.rs.try_close(self.policy)
                if decision is not None:
                    return decision
                self.lock.wait(timeout=max(0.01, min(self.rs.seconds_left(), 0.5)))
        return None

    def _describe(self, rs: RoundState, update: Update) -> ClosedRound:
        header = pb.RoundHeader(
            round=rs.round, aggregation=update.mode, alpha=update.alpha,
            finished=rs.round == self.cfg.rounds - 1, arrived=sorted(rs.arrivals),
            frames=[pb.FrameInfo(sender=f.sender, weight=f.weight, nbytes=len(f.data))
                    for f in update.frames],
        )
        return ClosedRound(header, b"".join(f.data for f in update.frames))

    def _apply(self, update: Update, closed: ClosedRound) -> None:
        """The outer step on the coordinator's parameters; the digest it sets is what the
        Rounds streams send after the frames (an error ends them instead)."""
        try:
            with torch.no_grad():
                apply_update(self.params, update)
            closed.digest.set_result(self.digest())
        except BaseException as exc:
            closed.digest.set_exception(exc)
            raise

    def _measure_val(self, next_round: int) -> bool:
        """After the last round always; else every ``coordinator.val_every`` rounds, whose
        default (None) is every round for small models and at checkpoints for large ones."""
        every = self.cfg.coordinator.val_every
        if next_round >= self.cfg.rounds:
            return True
        if every is None:
            if self.layout.numel < VAL_EVERY_ROUND_MAX_PARAMS:
                return True
            every = self.cfg.coordinator.checkpoint_every
        return bool(every) and next_round % every == 0

    def _publish(self, closed: ClosedRound) -> None:
        """Under the lock: keep the result, open the next round, wake every Rounds stream."""
        self.history.append(closed)
        while len(self.history) > 1 and sum(len(c.data) for c in self.history) > HISTORY_BYTES:
            self.history.popleft()
        self.rs = RoundState(closed.round + 1, self.cfg.coordinator.deadline_s)
        if not closed.finished:
            self.rs.open()
        for sub in self.subscribers.values():
            sub.put(closed)
        self.lock.notify_all()

    def _record(self, rs: RoundState, decision: Decision, closed: ClosedRound,
                counts: tuple[int, int], timing: RoundTiming, val: float | None) -> None:
        seconds = timing.published_at - (rs.opened_at or timing.published_at)
        arrivals = list(rs.arrivals.values())
        computes = [a.compute_seconds for a in arrivals]
        encodes = [a.encode_seconds for a in arrivals]
        losses = [a.train_loss for a in arrivals if a.train_loss == a.train_loss]
        chosen = [a for a, _ in rs.chosen()]
        m = RoundMetrics(
            round=rs.round, val_loss=val,
            train_loss=sum(losses) / len(losses) if losses else None,
            arrived=sorted(rs.arrivals), chosen=sorted(decision.coefficients),
            close_reason=decision.reason,
            upload_bytes={a.worker: len(a.data) for a in arrivals},
            download_bytes_per_worker=closed.header.ByteSize() + len(closed.data),
            round_seconds=seconds,
            compute_seconds=_mean(computes),
            wait_seconds=_mean([seconds - c for c in computes]),
            rejected_frames=counts[0], late_frames=counts[1],
            partitions_trained={a.worker: len(a.partitions) for a in arrivals},
            compute_seconds_max=max(computes, default=None),
            encode_seconds=_mean(encodes), encode_seconds_max=max(encodes, default=None),
            worker_apply_seconds_max=max((a.apply_seconds for a in arrivals), default=None),
            close_seconds=(timing.published_at - max(a.received_at for a in chosen)
                           if chosen else None),
            coordinator_apply_seconds=timing.applied_at - timing.published_at,
        )
        self.totals.add(m, max(self.registry.live_count, 1))
        self.metrics.write_round(m)
        log.info("round %d: val_loss %s, arrived %d/%d (%s), up %s B/worker, down %d B/worker, "
                 "%.2f s", m.round, _fmt(m.val_loss), len(m.arrived), self.cfg.workers,
                 m.close_reason,
                 f"{m.upload_bytes_mean:.0f}" if m.upload_bytes_mean is not None else "-",
                 m.download_bytes_per_worker, m.round_seconds)

    def _maybe_checkpoint(self, next_round: int) -> None:
        every = self.cfg.coordinator.checkpoint_every
        if every and next_round % every == 0 and next_round < self.cfg.rounds:
            self.save_checkpoint(next_round)

    def save_checkpoint(self, next_round: int) -> Path:
        """Write the parameters at the start of ``next_round`` with everything else."""
        with self.lock:
            workers = self.registry.to_dict()
        totals = asdict(self.totals)
        totals["wall_seconds"] = self.totals.wall_seconds + time.monotonic() - self._started_at
        with self._state_lock:
            params = {n: p.detach().clone() for n, p in zip(self._names(), self.params, strict=True)}
        ckpt = checkpoint.Checkpoint(next_round, params, self.outer.state_dict(), workers,
                                     self.layout.digest, totals)
        path = checkpoint.save(self.run_dir, ckpt)
        log.info("checkpoint %s (round %d)", path, next_round)
        return path

    def _finish_run(self) -> None:
        self._wait_finish_delivered()
        with self.lock:  # frames refused after the last round closed
            self.totals.rejected_frames += self.rejected
            self.totals.late_frames += self.late
            self.rejected = self.late = 0
        self.totals.wall_seconds += time.monotonic() - self._started_at
        self._started_at = time.monotonic()
        self.save_checkpoint(self.rs.round)
        dense = len(encode_dense(self.layout, self.params, round=0, sender=0, dtype="fp32"))
        path = self.metrics.write_summary(self.totals.summary(dense))
        log.info("run finished after %d rounds: val loss %s -> %s; summary %s",
                 self.totals.rounds, _fmt(self.totals.initial_val_loss),
                 _fmt(self.totals.final_val_loss), path)

    def _wait_finish_delivered(self) -> None:
        deadline = time.monotonic() + self.cfg.coordinator.deadline_s
        with self.lock:
            while not self.stopping and time.monotonic() < deadline:
                live = {i for i, r in self.registry.records.items() if r.live}
                if live <= self.delivered_finish:
                    return
                self.lock.wait(timeout=0.1)

    # ----- what the servicer calls (thread-safe) -------------------------------------

    def join(self, request: pb.JoinRequest) -> pb.JoinReply:
        reclaim = request.reclaim_worker_id if request.HasField("reclaim_worker_id") else None
        caps = request.capabilities
        with self.lock:
            record = self.registry.join(request.token, caps.hostname, caps.device, reclaim,
                                        request.reclaim_session)
            current = self.rs.round
            self.lock.notify_all()
        log.info("worker %d %s from %s (%s), round %d", record.worker_id,
                 "reclaimed its id" if reclaim is not None else "joined",
                 caps.hostname or "?", caps.device or "?", current)
        return pb.JoinReply(
            worker_id=record.worker_id, session=record.session,
            run_config_json=self.cfg.to_json(), current_round=current,
            layout_digest=self.layout.digest, wan_profile=self._wan_text(record.worker_id),
            straggler_profile=self.cfg.stragglers.profile_for(record.worker_id),
        )

    def _wan_text(self, worker_id: int) -> str:
        per = self.cfg.network.per_worker
        return per[worker_id] if worker_id < len(per) else self.cfg.network.wan

    def authenticate(self, worker_id: int, session: str) -> WorkerRecord:
        with self.lock:
            return self.registry.authenticate(worker_id, session)

    def task_for(self, worker: int, round: int) -> pb.WorkerTask:
        """What ``worker`` trains and sends in ``round`` (the gradient code decides)."""
        if round >= self.cfg.rounds or worker >= self.code.n:
            return pb.WorkerTask(round=round)
        coeffs = self.code.coefficients(worker)
        return pb.WorkerTask(
            round=round, train_partitions=self.code.partition_at(worker, round),
            send_partitions=[j for j, _ in coeffs], send_coefficients=[c for _, c in coeffs],
        )

    def state_snapshot(self, record: WorkerRecord) -> tuple[int, str, bytes]:
        """(round, digest, dense fp32 frame) of the parameters at the open round's start."""
        with self.lock:
            record.state_fetches += 1
            self.ready.add(record.worker_id)
            self.lock.notify_all()
            if record.state_fetches > 1:
                self.totals.extra_state_fetches += 1
        with self._state_lock:
            round = self.rs.round
            if self._state_cache is None or self._state_cache[0] != round:
                data = encode_dense(self.layout, self.params, round=round, sender=0, dtype="fp32")
                self._state_cache = (round, self.digest(), data)
            return self._state_cache

    def check_push(self, record: WorkerRecord, round: int) -> None:
        with self.lock:
            try:
                self.rs.check_push(record.worker_id, round)
            except RoundError:
                self._count_refused(round)
                raise

    def accept(self, arrival: Arrival) -> None:
        """Add a decoded frame to the open round (RoundError if it closed meanwhile)."""
        with self.lock:
            try:
                self.rs.accept(arrival)
            except RoundError:
                self._count_refused(arrival.frame.round)
                raise
            self.lock.notify_all()

    def _count_refused(self, round: int) -> None:
        if round < self.rs.round or (round == self.rs.round and self.rs.closed):
            self.late += 1
        else:
            self.rejected += 1

    def count_rejected(self) -> None:
        with self.lock:
            self.rejected += 1

    def subscribe(self, worker: int, from_round: int) -> tuple[queue.Queue, list[ClosedRound]]:
        """A queue that receives every later round result, and the held results from
        ``from_round`` on (a gap before them makes the worker FetchState)."""
        sub: queue.Queue[ClosedRound | None] = queue.Queue()
        with self.lock:
            old = self.subscribers.get(worker)
            if old is not None:
                old.put(None)
            self.subscribers[worker] = sub
            self.ready.add(worker)
            self.lock.notify_all()
            backlog = [c for c in self.history if c.round >= from_round]
        return sub, backlog

    def unsubscribe(self, worker: int, sub: queue.Queue) -> None:
        with self.lock:
            if self.subscribers.get(worker) is sub:
                del self.subscribers[worker]

    def mark_finish_delivered(self, worker: int) -> None:
        with self.lock:
            self.delivered_finish.add(worker)
            self.lock.notify_all()

    def open_round(self) -> int:
        with self.lock:
            return self.rs.round


def check_aggregation(cfg: RunConfig) -> None:
    """``mean_kept`` divides each coordinate by the number of frames that kept it, which
    is not the decoded sum of coded messages: only the uncoded ``none`` scheme allows it."""
    if cfg.outer.aggregation == "mean_kept" and cfg.coding.scheme != "none":
        raise ConfigError(
            f"outer.aggregation 'mean_kept' cannot decode coding.scheme {cfg.coding.scheme!r} "
            "(the decoding coefficients need a weighted sum); use outer.aggregation 'mean', "
            "or coding.scheme 'none'"
        )


def coding_summary(code: GradientCode) -> dict[str, object]:
    """The gradient code's figures for summary.json."""
    return {"coding_scheme": code.name, "coding_stragglers": code.s,
            "worst_case_coefficient": code.worst_case_coefficient}


@dataclass
class RoundTiming:
    """The coordinator's clock for one round after it closed."""

    published_at: float
    applied_at: float = 0.0


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "-"


def run_coordinator(cfg: RunConfig, run_dir: Path, resume: bool = False) -> int:
    """Serve until every round is done (or Ctrl-C), write the final checkpoint and
    summary.json, stop; returns the process exit code."""
    coordinator = Coordinator(cfg, Path(run_dir), resume=resume)
    coordinator.start()
    previous = _sigterm_as_interrupt()
    try:
        while not coordinator.wait(timeout=1.0):
            pass
    except KeyboardInterrupt:
        log.warning("interrupted: checkpointing round %d and stopping", coordinator.rs.round)
        coordinator.stop()
        coordinator.save_checkpoint(coordinator.rs.round)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    coordinator.stop()
    return 1 if coordinator.failed else 0


def _sigterm_as_interrupt():  # -> the previous handler, or None off the main thread
    """SIGTERM (a launcher or docker stop) checkpoints and stops like Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)
