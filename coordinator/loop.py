"""The coordinator's round loop, one named step after another: wait for the round to
close, take the outer step, publish the result, apply it, record, checkpoint
(round protocol: docs/protocol.md)."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Protocol

from torch import Tensor, nn

from geoloco.compression.format import dense_frame_bytes
from geoloco.config import RunConfig
from geoloco.coordinator import checkpoint, roundlog
from geoloco.coordinator.bounds import FrameBounds
from geoloco.coordinator.metrics import (
    ClosePhases,
    MetricsWriter,
    RoundMetrics,
    RoundTiming,
    round_metrics,
)
from geoloco.coordinator.outer import OuterOptimizer, Update
from geoloco.coordinator.rounds import Arrival, ClosedRound, ClosePolicy, Decision, RoundState
from geoloco.coordinator.state import CoordinatorState
from geoloco.protos import geoloco_pb2 as pb
from geoloco.schedule import lr_at
from geoloco.tasks import Task

log = logging.getLogger(__name__)

CRASH_AFTER_BROADCAST_S = 0.5  # the seam lets the frames go out before it kills
VAL_EVERY_ROUND_MAX_PARAMS = 20_000_000  # val_every None: larger models only at checkpoints/end
VAL_COST_SHARE = 0.10  # val_every None: a small model's validation takes at most this of a round


def val_interval(val_seconds: float | None, round_seconds: float | None,
                 share: float = VAL_COST_SHARE) -> int:
    """Rounds between validation losses so that one evaluation (``val_seconds``) costs at
    most ``share`` of the rounds it covers: 1 until both times are known."""
    if not val_seconds or not round_seconds or round_seconds <= 0:
        return 1
    return max(1, math.ceil(val_seconds / (share * round_seconds)))


class RoundObserver(Protocol):
    """Something that takes every round's metrics beside metrics.jsonl (Prometheus,
    TensorBoard)."""

    def write_round(self, m: RoundMetrics) -> None:
        """Called once per closed round, after its line is in metrics.jsonl."""


class RoundLoop:
    """Runs every round of one run over ``state``; ``done`` is set when the run ends."""

    def __init__(self, cfg: RunConfig, state: CoordinatorState, policy: ClosePolicy,
                 outer: OuterOptimizer, task: Task, model: nn.Module, run_dir: Path,
                 model_files: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.state = state
        self.policy = policy
        self.outer = outer
        self.task = task
        self.model = model  # its parameters are state.params
        self.model_files = model_files or {}  # config.json (and tokenizer.json) beside the weights
        self.fixed = fixed_tensors(model, state.params)
        self.run_dir = Path(run_dir)
        self.metrics = MetricsWriter(self.run_dir)
        self.observers: list[RoundObserver] = []
        self.bounds = FrameBounds(cfg.guard, state.params)
        self.failed = False
        self.done = threading.Event()
        self.crash_at: tuple[str, int] | None = None  # the test seam: (stage, round) to SIGKILL at
        self._started_at = time.monotonic()
        self.val_seconds: float | None = None  # the last validation's cost
        self.round_seconds: float | None = None  # the last round's, from open to broadcast
        self.replayed: int | None = None  # rounds replayed from the round log (None: not yet)
        self.unlogged_from: int | None = None  # the first round the round log misses, until a checkpoint

    def run(self) -> None:
        """The rounds logged after the checkpoint, the initial loss, the joins, every
        round, then the end of the run."""
        try:
            replayed = self.replay() if self.replayed is None else self.replayed
            if self.state.open_round() >= self.cfg.rounds:
                if not replayed:
                    log.info("all %d rounds were already done in %s; nothing to do",
                             self.cfg.rounds, self.run_dir)
                    return
                # the last round was replayed: those waiting for its result rejoin for it
                self.state.wait_finish_delivered(self.cfg.coordinator.join_timeout_s,
                                                 every=self.cfg.workers)
                self.save_final()
                return
            self.measure_initial_loss()
            if self.state.wait_for_joins(self.cfg.workers, self.cfg.coordinator.join_timeout_s):
                while self.state.open_round() < self.cfg.rounds and not self.state.stopping:
                    self.run_round()
            if not self.state.stopping:
                self.finish()
        except Exception:  # noqa: BLE001 - the loop must report and end the run
            self.failed = True
            log.exception("coordinator round loop failed at round %d", self.state.open_round())
        finally:
            self.done.set()

    def replay(self) -> int:
        """Apply the rounds whose close decision is in the round log (a resumed run), as
        they were decided, and keep them for the Rounds streams of the workers that rejoin;
        returns how many. Coordinator.start calls it before it serves, so that a rejoining
        worker's Join sees the replayed round (else a worker ahead of the checkpoint is
        sent back to it and trains and applies a round twice)."""
        entries = roundlog.read(self.run_dir, self.state.open_round())
        self.replayed = len(entries)
        for entry in entries:
            closed, update = entry.closed(), entry.update(self.state.layout)
            if entry.sources:
                update = self.replay_aggregate(entry, update)
            with self.state.publishing(closed):
                self.state.apply(update, closed)
            self.bounds.remember(entry.round, update)
            m = RoundMetrics(**_worker_keys(entry.metrics))
            m.val_loss = self.task.val_loss(self.model) if self.val_due(entry.round + 1) else None
            self.write_metrics(m)
            log.info("round %d replayed from the round log (%d frames, digest %s)", entry.round,
                     len(closed.parts), closed.digest.result()[:16])
        return len(entries)

    def replay_aggregate(self, entry: roundlog.LoggedRound, update: Update) -> Update:
        """Aggregate and compress a logged round's frames again, as its close did, so the
        coordinator's error feedback after the replay is what the round left (the codec is
        deterministic: the frame must be the logged one)."""
        sources = entry.source_frames(self.state.layout)
        again = self.outer.combine(entry.round, sources, entry.source_mode)
        if [f.data for f in again.frames] != [f.data for f in update.frames]:
            log.error("round %d replayed: its aggregate compressed to another frame than the one "
                      "broadcast; the coordinator's error feedback may differ from the run's", entry.round)
        return replace(update, sources=again.sources, source_mode=again.source_mode)  # applied as logged

    def run_round(self) -> None:
        """Close, broadcast at once, then apply and digest while the frames travel; the
        validation loss is measured last, off the workers' critical path."""
        rs = self.state.wait_for_close(self.policy)
        if rs is None:
            return  # stopping
        phases = ClosePhases()
        self.policy.observe(rs.times())
        verdict = self.bounds.bound_round(rs, self.policy)
        phases.end("bounds")
        chosen = rs.chosen()
        admitted = self.admits(chosen, rs.decision)
        update = self.outer.step(rs.round, chosen, rs.decision) if admitted else Update([], "sum", 1.0)
        settlements = {i: self.policy.settlement(rs.decision, i) for i in range(self.cfg.workers)}
        if update.aggregated:
            attach_mate_frames(settlements, rs)
        if not admitted or not self.bounds.safe(update):
            log.error("round %d: the update of workers %s could make parameters non-finite; "
                      "committing no change", rs.round, sorted(arr.worker for arr, _ in chosen))
            if admitted:
                self.outer.discard()
            update = Update([], "sum", 1.0)
            # nothing was applied: every worker keeps its message in its error feedback
            settlements = {i: pb.Settlement(kind=pb.Settlement.RESTORE) for i in settlements}
        self.bounds.remember(rs.round, update)
        closed = round_result(rs, update, settlements, finished=rs.round == self.cfg.rounds - 1)
        phases.end("aggregate")
        self.log_decision(rs, closed, update)
        phases.end("log")
        self.crash_point("decision", rs.round)
        with self.state.publishing(closed):  # FetchState waits for the apply
            timing = RoundTiming(published_at=time.monotonic(), wall_time=time.time(),
                                 elapsed_seconds=self.elapsed_seconds(), phases=phases)
            phases.end("publish")
            self.crash_point("broadcast", rs.round)
            self.state.apply(update, closed, phases)
        timing.applied_at = time.monotonic()
        if rs.opened_at is not None:
            self.round_seconds = timing.published_at - rs.opened_at
        val = self.validate() if self.val_due(rs.round + 1) else None
        self.record(rs, closed, timing, val, verdict.reference)
        self.checkpoint_if_due(rs.round + 1)

    def admits(self, chosen: list[tuple[Arrival, float]], decision: Decision) -> bool:
        """Whether the frame guard admits the round before its step, where the step cannot
        be undone (an in-place aggregate: ``OuterOptimizer.worst_move``); a running bound
        that does not admit it is measured once before it refuses."""
        move = self.outer.worst_move(chosen, decision)
        if move is None or self.bounds.admits(move):
            return True
        self.outer.measure_bound()
        return self.bounds.admits(self.outer.worst_move(chosen, decision))

    def log_decision(self, rs: RoundState, closed: ClosedRound, update: Update) -> None:
        """The close decision to the round log, durably, before anything is broadcast. A
        decision that cannot be written (disk full and the like) is one error line, and the
        round goes on unlogged, as do the rounds after it until a checkpoint covers them:
        the log never holds a round after a missing one, so a resume replays up to the gap
        and redoes the rest from the checkpoint (docs/protocol.md, "A full disk")."""
        try:
            if self.unlogged_from is None:
                self.append_decision(rs, closed, update)
        finally:
            if self.state.spool is not None:
                self.state.spool.settled(rs.round)  # its frames are durable or not needed

    def append_decision(self, rs: RoundState, closed: ClosedRound, update: Update) -> None:
        now = time.monotonic()
        timing = RoundTiming(published_at=now, applied_at=now, wall_time=time.time(),
                             elapsed_seconds=self.elapsed_seconds())
        draft = round_metrics(rs, closed, timing, None, self.lr_of(rs.round))
        sources = tuple((f.sender, f.weight, f.data) for f in update.sources)
        entry = roundlog.LoggedRound(closed.header, closed.parts, closed.settlements, asdict(draft), sources,
                                     update.source_mode)
        try:
            roundlog.append(self.run_dir, entry, self.state.spool)
        except OSError as exc:
            self.unlogged_from = rs.round
            self.pause_spool(True)
            log.error("round %d: its close decision was not written to the round log (%s); training goes "
                      "on, and until the next checkpoint a coordinator killed redoes these rounds from the "
                      "last checkpoint instead of replaying them", rs.round, exc.strerror or exc)

    def pause_spool(self, paused: bool) -> None:
        """The round log's frame writer off while the log is (a decision was not written),
        on again once a checkpoint covers the rounds it missed."""
        if self.state.spool is not None:
            self.state.spool.paused = paused

    def crash_point(self, stage: str, round: int) -> None:
        """The test seam of exactly-once: SIGKILL this process at ``stage`` of ``round``:
        "decision" (logged, not broadcast), "broadcast" (sent, not applied: the apply is in
        memory, so a kill during it leaves what this one leaves) or "checkpoint" (the
        checkpoint after the round half written: its weights in the temporary folder, no
        sidecar)."""
        if self.crash_at == (stage, round):
            if stage == "broadcast":
                time.sleep(CRASH_AFTER_BROADCAST_S)  # the frames on their way, the digest not
            log.warning("crash point %s of round %d: SIGKILL", stage, round)
            os.kill(os.getpid(), signal.SIGKILL)

    def lr_of(self, round: int) -> float:
        inner = self.cfg.inner
        return lr_at(inner, round * inner.steps, self.cfg.rounds * inner.steps)

    def measure_initial_loss(self) -> None:
        totals = self.state.totals
        if totals.initial_val_loss is None:
            totals.initial_val_loss = self.validate()
            log.info("initial validation loss %.4f (%.1f s)", totals.initial_val_loss,
                     self.val_seconds)

    def validate(self) -> float:
        """The validation loss of the global model, and what measuring it cost."""
        started = time.monotonic()
        loss = self.task.val_loss(self.model)
        self.val_seconds = time.monotonic() - started
        return loss

    def val_due(self, next_round: int) -> bool:
        """After the last round always; else every ``coordinator.val_every`` rounds, whose
        default (None) is, for small models, every round while a validation costs under
        VAL_COST_SHARE of a round (else as rarely as keeps it so: ``val_interval``), and at
        checkpoints for large ones."""
        every = self.cfg.coordinator.val_every
        if next_round >= self.cfg.rounds:
            return True
        if every is None:
            if self.state.layout.numel < VAL_EVERY_ROUND_MAX_PARAMS:
                every = val_interval(self.val_seconds, self.round_seconds)
            else:
                every = self.cfg.coordinator.checkpoint_every
        return bool(every) and next_round % every == 0

    def record(self, rs: RoundState, closed: ClosedRound, timing: RoundTiming,
               val: float | None, median_norm: float | None = None) -> None:
        """The round's line in metrics.jsonl, the run totals, one log line."""
        m = round_metrics(rs, closed, timing, val, self.lr_of(rs.round))
        m.median_frame_norm = median_norm
        self.write_metrics(m)
        up = f"{m.upload_bytes_mean:.0f}" if m.upload_bytes_mean is not None else "-"
        log.info("round %d: val_loss %s, arrived %d/%d (%s), up %s B/worker, down %d B/worker, "
                 "%.2f s", m.round, _fmt(m.val_loss), len(m.arrived), self.cfg.workers,
                 m.close_reason, up, m.download_bytes_per_worker, m.round_seconds)

    def write_metrics(self, m: RoundMetrics) -> None:
        self.state.totals.add(m, max(self.state.live_count(), 1))
        try:
            self.metrics.write_round(m)
        except OSError as exc:
            log.error("round %d: its metrics line was not written (%s)", m.round, exc.strerror or exc)
        for observer in self.observers:
            observer.write_round(m)

    def elapsed_seconds(self) -> float:
        """The run's wall time so far, the time before a resume included."""
        return self.state.totals.wall_seconds + time.monotonic() - self._started_at

    def checkpoint_if_due(self, next_round: int) -> None:
        every = self.cfg.coordinator.checkpoint_every
        if every and next_round % every == 0 and next_round < self.cfg.rounds:
            self.try_checkpoint(next_round)

    def try_checkpoint(self, next_round: int) -> Path | None:
        """save_checkpoint, or (disk full and the like) one error line and None: training
        goes on and the next checkpoint tries again."""
        try:
            return self.save_checkpoint(next_round)
        except checkpoint.CheckpointWriteError as exc:
            log.error("%s; training goes on, the next checkpoint tries again", exc)
            return None

    def save_checkpoint(self, next_round: int) -> Path:
        """Write the parameters at the start of ``next_round`` with everything else."""
        workers = self.state.workers_dict()
        totals = asdict(self.state.totals)
        totals["wall_seconds"] = self.elapsed_seconds()
        names = [spec.name for spec in self.state.layout.specs]
        # the parameters and the outer state themselves, not copies (a model's size each):
        # the outer state changes on this thread alone, and the apply waits for the write
        with self.state.params_between_rounds() as live:
            ckpt = checkpoint.Checkpoint(next_round, dict(zip(names, live, strict=True)), self.outer.state_dict(),
                                         workers, self.state.layout.digest, totals, fixed=self.fixed,
                                         files=self.model_files, guard_norms=dict(self.bounds.recent))
            path = checkpoint.save(self.run_dir, ckpt,
                                   after_weights=lambda: self.crash_point("checkpoint", next_round - 1))
        roundlog.prune(self.run_dir, next_round)
        self.unlogged_from = None  # the checkpoint covers the rounds the log missed
        self.pause_spool(False)
        log.info("checkpoint %s (%s)", path, checkpoint.starts(next_round))
        return path

    def finish(self) -> None:
        """Wait for the last result to reach the workers, then the final checkpoint and
        summary.json."""
        self.state.wait_finish_delivered(self.cfg.coordinator.deadline_s)
        self.save_final()

    def save_final(self) -> None:
        """The checkpoint at the open round and summary.json, at the end of the run or
        when it is stopped."""
        totals = self.state.totals
        rejected, late = self.state.take_refused()  # frames refused after the last round closed
        totals.rejected_frames += rejected
        totals.late_frames += late
        totals.wall_seconds += time.monotonic() - self._started_at
        self._started_at = time.monotonic()
        self.try_checkpoint(self.state.open_round())
        dense = dense_frame_bytes(self.state.layout, "fp32")  # what the summary compares frames with
        path = self.metrics.write_summary(totals.summary(dense))
        log.info("run %s after %d rounds: val loss %s -> %s; summary %s",
                 "finished" if totals.rounds >= self.cfg.rounds else "stopped", totals.rounds,
                 _fmt(totals.initial_val_loss), _fmt(totals.final_val_loss), path)


def fixed_tensors(model: nn.Module, shared: list[Tensor]) -> dict[str, Tensor]:
    """Copies of the model's state-dict tensors that the replicas do not share (frozen
    parameters, integer buffers): never changed, but part of the model a checkpoint saves.
    A name of a tensor already saved (a tied weight) is left out."""
    seen = {t.data_ptr() for t in shared}
    fixed = {}
    for name, t in model.state_dict().items():
        if t.numel() == 0 or t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            fixed[name] = t.detach().clone()
    return fixed


def _worker_keys(metrics: dict) -> dict:
    """A metrics dict read back from JSON, its per-worker maps keyed by int again."""
    return {k: {int(w) if str(w).isdigit() else w: v for w, v in val.items()}
            if isinstance(val, dict) else val for k, val in metrics.items()}


def attach_mate_frames(settlements: dict[int, pb.Settlement], rs: RoundState) -> None:
    """An aggregated result does not carry the workers' frames: a CREDIT settlement gets the
    group-mate's frame it credits, for that worker alone (docs/gradient-coding.md)."""
    for settlement in settlements.values():
        if settlement.kind == pb.Settlement.CREDIT:
            settlement.mate_frame = rs.arrivals[settlement.sender].data


def round_result(rs: RoundState, update: Update, settlements: dict[int, pb.Settlement],
                 finished: bool) -> ClosedRound:
    """The broadcast of the closed round ``rs``: its header, the update's frames and what
    each worker does with the error feedback of its own frame."""
    header = pb.RoundHeader(
        round=rs.round, aggregation=update.mode, alpha=update.alpha, finished=finished,
        arrived=sorted(rs.arrivals),
        frames=[pb.FrameInfo(sender=f.sender, weight=f.weight, nbytes=len(f.data))
                for f in update.frames],
    )
    return ClosedRound(header, tuple(f.data for f in update.frames), settlements)


def _fmt(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "-"
