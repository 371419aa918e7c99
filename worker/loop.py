"""The worker's round loop (docs/protocol.md, steps 4 to 6): from θ_r train the task's
partitions (H inner AdamW steps each, DiLoCo/SparseLoCo, arXiv 2508.15706), confirm θ_r's
digest, encode, push, then apply the round's result; every call to the coordinator goes
through a geoloco.worker.session.Session.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from geoloco import transport
from geoloco.compression import FrameError, Layout, decode_frame, on_huge_pages
from geoloco.compression.shards import ShardCompressor
from geoloco.config import FOLD_ARRIVAL, RunConfig, validate
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import param_digest, replica_layout
from geoloco.run_dir import write_atomic
from geoloco.tasks import build_task
from geoloco.tasks.data import describe_source
from geoloco.transport import CoordinatorUnreachable, JoinRefused
from geoloco.worker import local_state, overlap
from geoloco.worker.admission import Admission, ConfigRefused
from geoloco.worker.density import DensityChooser
from geoloco.worker.encoder import FrameEncoder, IslandFrameEncoder, island_state
from geoloco.worker.identity import IdentityStore
from geoloco.worker.island import LAUNCHER_PID_ENV, Island, cpu_state, optimizer_tensors
from geoloco.worker.island_state import IslandState
from geoloco.worker.local_state import LocalStateError
from geoloco.worker.partitions import LatestDeltas
from geoloco.worker.session import Push, Session, State
from geoloco.worker.stragglers import StragglerModel, make_straggler, occupy
from geoloco.worker.stream import Behind, DigestCheck, Disconnected, RoundResult
from geoloco.worker.trainer import (
    Fold,
    InnerStep,
    InnerTrainer,
    TrainingStopped,
    describe_device,
    resolve_device,
)

log = logging.getLogger(__name__)

EXIT_STOPPED = 130  # run()'s code after stop(), the same as an interrupt's
STATE_COST_SHARE = 0.05  # worker.state_every None: local state saves take at most this of a round


class Stopped(Exception):
    """stop() was called: the loop ends where it is, without finishing the run."""


class FoldAbandoned(Exception):
    """A mid-phase fold left θ elsewhere than at the phase's round: the phase is dropped."""


@dataclass
class Counters:
    """What worker-<id>.json reports beside the status (the launcher sums the resyncs)."""

    resyncs: int = 0
    digest_mismatches: int = 0
    rejected_pushes: int = 0
    reconnects: int = 0
    bytes_pushed: int = 0
    bytes_received: int = 0
    rounds_applied: int = 0


@dataclass
class Training:
    """What the first Join's run config builds: the inner trainer (the model on the training
    device), the parameter layout, the frame encoder, the straggler model, and the latest
    pseudo-gradient of every partition."""

    cfg: RunConfig
    trainer: InnerTrainer
    layout: Layout
    encoder: FrameEncoder
    straggler: StragglerModel
    density: DensityChooser
    deltas: LatestDeltas = field(default_factory=LatestDeltas)
    state: IslandState | None = None  # an fsdp island's outer state in pieces: rank 0's (then its deltas)

    @property
    def shard(self) -> ShardCompressor | None:
        """Rank 0's share of an fsdp island's error feedback (None: the encoder holds it whole)."""
        return self.state.shard if self.state is not None else None

    def message(self, task: pb.WorkerTask) -> list[Tensor]:
        """The task's coded message (LatestDeltas.message). In an fsdp island every rank makes
        its pieces of it; under SparseLoCo they stay there for the encoder, and rank 0 gets
        its own; a dense frame gets the message whole on rank 0."""
        state = self.state
        if state is None:
            return self.deltas.message(task)
        whole = state.shard is None
        state.island.send("message", task.SerializeToString(), whole)
        mine = state.make_message(task)
        return state.whole_message() if whole else mine

    @classmethod
    def from_join(cls, reply: pb.JoinReply, device: torch.device, precision: str = "fp32",
                  inner_step: InnerStep | None = None, admission: Admission | None = None,
                  island: Island | None = None) -> Training:
        """Built from the run config the coordinator sent, once ``admission`` allows what it
        asks for (JoinRefused otherwise, before any file it names is read); the codec is
        warmed before round 0. In an ``island`` the trainer trains with the other ranks."""
        cfg = RunConfig.from_dict(json.loads(reply.run_config_json))
        try:
            (admission or Admission()).check(cfg, reply.straggler_profile)
        except ConfigRefused as exc:
            raise JoinRefused(str(exc)) from None
        cfg = validate(cfg)
        if island is not None and cfg.task.batch_size % island.size:
            raise JoinRefused(f"task.batch_size {cfg.task.batch_size} (the island's batch) does not "
                              f"split between this worker's {island.size} ranks; run a number of "
                              "ranks that divides it")
        task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
        expected = cfg.task.data_fingerprint
        if expected is not None and task.fingerprint != expected:
            raise JoinRefused(
                f"data mismatch: this worker's data ({task.n_tokens} {task.unit} from "
                f"{describe_source(cfg.task.data)}, tokenizer {task.tokenizer.name}) has fingerprint "
                f"{task.fingerprint}, the coordinator's {expected}; give every machine the same "
                "task.data (the default, the pinned corpus, is the same everywhere; task.data "
                "\"stdlib\" is each machine's own Python standard library)")
        trainer = InnerTrainer(task, cfg.inner, cfg.rounds, device, precision, inner_step, island)
        layout = replica_layout(trainer.model)
        if reply.layout_digest and reply.layout_digest != layout.digest:
            raise JoinRefused(f"layout mismatch: coordinator {reply.layout_digest.hex()} vs this worker "
                              f"{layout.digest.hex()}; run the same geoloco version on both sides")
        straggler = make_straggler(reply.straggler_profile or "none", reply.worker_id, cfg.seed)
        density = DensityChooser.from_config(cfg.compression)
        undoable = cfg.coding.scheme != "none"
        state = (island_state(island, layout, cfg.compression, undoable, density.density)
                 if island is not None and island.sharded else None)
        encoder = (IslandFrameEncoder(state, layout, cfg.compression) if state is not None and state.shard is not None
                   else FrameEncoder(layout, cfg.compression, undoable=undoable, density=density.density))
        encoder.warm_up()
        if state is None:
            return cls(cfg, trainer, layout, encoder, straggler, density)
        trainer.island_state = state
        return cls(cfg, trainer, layout, encoder, straggler, density, state.deltas, state)


@dataclass
class Trained:
    """One round's inner loops: the partitions trained, their time and mean loss."""

    partitions: list[int]
    compute_s: float
    loss: float
    round: int = -1  # the round it was trained for


class Worker:
    """One worker: θ, the CPU fp32 master copy of the global parameters at the start of
    ``round`` (the global track, the same on every replica), and the loop that plays one
    round after the other over its Session. Under outer.overlap the next round's inner
    phase runs from a running copy (geoloco.worker.overlap) while ``round``'s frame is in
    flight.
    ``precision`` is the inner loop's autocast (worker.precision); ``inner_step`` replaces
    the inner training step (geoloco.worker.trainer.InnerStep). In an ``island`` this is rank
    0, and the inner phase is the island's (geoloco.worker.island)."""

    def __init__(self, session: Session, device: str = "auto", report_dir: Path | None = None,
                 max_resyncs: int = 50, precision: str = "auto",
                 inner_step: InnerStep | None = None, state_dir: Path | None = None,
                 state_every: int | None = None, admission: Admission | None = None,
                 island: Island | None = None) -> None:
        self.session = session
        self.island = island  # the ranks this worker trains with (None: it trains alone)
        self.held: dict[str, list[int]] | None = None  # fsdp: what each rank holds (finish)
        self.admission = admission or Admission()  # what the run config may make it do
        self.device = resolve_device(device)
        self.precision = precision
        self.inner_step = inner_step
        self.stopping = threading.Event()  # stop() was called
        self.report_dir = report_dir  # worker-<id>.json goes there (join, then the final digest)
        self.max_resyncs = max_resyncs  # give up if the replica keeps diverging
        self.training: Training | None = None  # built at the first Join
        self.state_dir = state_dir  # the worker's own state goes there (None: nowhere)
        self.identities = IdentityStore(state_dir) if state_dir is not None else None
        self.state_every = state_every  # rounds between saves; None: measured (STATE_COST_SHARE)
        self.state_interval = 1  # the measured one
        self.state_saved_round = -1
        self.applied_at: float | None = None  # when the last round result was applied
        self.theta: list[Tensor] = []
        self.round = -1
        self.task: pb.WorkerTask | None = None  # None: θ is not known to be the coordinator's
        self.check: DigestCheck | None = None  # of θ, while it runs beside the inner loop
        self.outbox: Push | None = None  # this round's frame, kept to push again after a reconnect
        self.trained: Trained | None = None  # this round's training while θ awaits its confirmation
        self.apply_s = 0.0  # applying the last round result (reported in the next Push)
        self.counters = Counters()
        self.next_task: pb.WorkerTask | None = None  # the task of round + 1, sent ahead
        self.inflight: Push | None = None  # overlap: round's frame, pushed, its result not in
        self.pushing: Future[None] | None = None  # that push, on the push thread
        self.running: list[Tensor] | None = None  # overlap: what round + 1's phase trains from
        self.ahead: Trained | None = None  # overlap: round + 1 trained before round's result
        self.folding: int | None = None  # outer.fold_step: the round whose phase folds mid-way
        self.folded: bool | None = None  # ... and apply's answer once it folded (None: not yet)
        self.fold_at: int | None = None  # ... and the inner step it folded before
        self.late: RoundResult | None = None  # fold_step "arrival": the result in flight, once its header is in
        self.fold_wait_s = 0.0  # the phase's time in fold_mid_phase, not counted as compute
        self.catching_up = False  # after a resync, reconnect or restore: the next round waits
        self.density = 0.0  # the last frame's density (0: dense)
        self._pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push")
        self.state_writer = local_state.StateWriter()  # the local state, written beside the rounds
        self.state_write: tuple[Path, int, float, float | None] | None = None  # ... what is in flight

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Join, then play one round after the other until the coordinator says the run is
        finished; returns the exit code (0; EXIT_STOPPED after stop()). A lost connection
        rejoins with the same id."""
        try:
            try:
                self.connect()
            except Disconnected as exc:
                self.reconnect(str(exc))
            finished = False
            while not finished:
                try:
                    finished = self.play_round()
                except Behind as exc:
                    self.task = None  # the result it waits for is gone: fetch the state
                    self.reconnect(str(exc))
                except Disconnected as exc:
                    self.reconnect(str(exc))
        except (Stopped, TrainingStopped):
            log.info("worker %s stopped at round %d", self.session.worker_id, self.round)
            self.write_report("stopped")
            self.close()
            return EXIT_STOPPED
        self.finish()
        return 0

    def stop(self) -> None:
        """End run() from another thread (or a signal handler): the session closes, so a
        call waiting on the coordinator returns, the inner loop ends at its next step, and
        the loop ends instead of rejoining."""
        self.stopping.set()
        self.session.stop()

    def play_round(self) -> bool:
        """One round from θ_r: train → confirm θ_r → straggle → encode → push → apply.
        Early exits: a result already in skips whatever is left before it is applied, and a
        θ_r that fails its digest check drops what was trained (the state is fetched again,
        the round starts over). Under outer.overlap the push goes to the push thread and
        the round ends there; the next call trains round r + 1 and then folds round r's
        result in (fold_late). True when the run is finished."""
        if self.stopping.is_set():
            raise Stopped("stop() was called")
        if self.inflight is not None:
            return self.fold_late()
        if self.run_over():
            return True
        result = self.session.poll_result(self.round)
        if result is None and self.outbox is None and self.has_work():
            trained = self.take_ahead()  # trained from θ_{r-1} (confirmed) while r-1 travelled
            if trained is None:
                # kept across a reconnect that left θ as it was: the data and AdamW went on once
                trained = self.trained or self.train()
                self.trained = trained
                if not self.confirm():
                    self.trained = None
                    return False
                self.emulate_straggler(trained)
            self.outbox, self.trained = self.encode(trained), None
            if self.may_overlap():
                self.push_ahead(trained)
                return False
            result = self.session.poll_result(self.round)
        if result is None and self.outbox is not None:
            self.push(self.outbox)
        if result is None:
            result = self.session.next_result(self.round)
        return self.apply(result)

    # ------------------------------------------------------------------ the steps of a round

    def has_work(self, task: pb.WorkerTask | None = None) -> bool:
        task = self.task if task is None else task
        return task is not None and bool(task.train_partitions or task.send_partitions)

    def train(self, task: pb.WorkerTask | None = None, theta: list[Tensor] | None = None,
              round_: int | None = None, fold: Fold | None = None) -> Trained:
        """H inner steps from θ_r (or ``theta``, for ``round_``) on every partition the task
        trains; each Δ is kept. ``fold``: InnerTrainer's mid-phase fold (fold_mid_phase),
        whose wait is not counted as compute."""
        task, theta = task or self.task, self.theta if theta is None else theta
        round_ = self.round if round_ is None else round_
        training, start, losses = self.training, time.monotonic(), []
        self.fold_wait_s = 0.0
        partitions = training.deltas.to_train(task)
        for p in partitions:
            delta, loss = training.trainer.train_partition(theta, p, round_, self.stopping, fold)
            if delta is not None:  # else each rank of an fsdp island kept its pieces
                training.deltas.keep(p, delta)
            losses.append(loss)
        mean_loss = sum(losses) / len(losses) if losses else math.nan
        return Trained(partitions, time.monotonic() - start - self.fold_wait_s, mean_loss, round_)

    # ------------------------------------------------------------------ overlapped rounds

    def may_overlap(self) -> bool:
        """Whether this round's push may overlap the next round's inner phase: the overlap
        is on, this is not a catch-up round, and the next round's task is known and has
        work (the last round waits for its result)."""
        mode = self.training.cfg.outer.overlap
        return mode != "none" and not self.catching_up and self.next_task is not None \
            and self.has_work(self.next_task)

    def push_ahead(self, trained: Trained) -> None:
        """Push this round's frame on the push thread and set up the running copy that the
        next round's inner phase starts from (geoloco.worker.overlap)."""
        cfg = self.training.cfg
        self.inflight = self.outbox
        self.pushing = self._pusher.submit(self.push, self.outbox)
        scale, copy = overlap.standin_scale(cfg, len(trained.partitions)), cfg.outer.fold_step is not None
        state = self.training.state
        if state is not None:  # every rank makes its pieces of it
            self.island.send("running", cfg.outer.overlap, trained.partitions, scale, copy)
            state.make_running(cfg.outer.overlap, trained.partitions, scale, copy)
            self.running = state.running
        else:
            own = [self.training.deltas.latest[p] for p in trained.partitions]
            self.running = overlap.running_copy(cfg.outer.overlap, self.theta, own, scale, copy=copy)
        log.info("round %d: frame on its way; round %d trains from the running copy (%s)",
                 self.round, self.round + 1, cfg.outer.overlap)

    def fold_late(self) -> bool:
        """Train round r + 1 from the running copy while round r's frame and result travel,
        then fold round r's result into θ (the global track) as a plain apply: the digest
        check of θ_r, the apply, the settlement of round r's frame; at the end of the phase,
        or before its inner step outer.fold_step (fold_mid_phase). True when finished."""
        round_, task = self.inflight.round + 1, self.next_task
        step = self.training.cfg.outer.fold_step
        when = self.result_in if step == FOLD_ARRIVAL else step
        self.folding, self.folded, self.fold_at = round_, None, None
        try:
            trained = self.train(task, self.running, round_, None if when is None else (when, self.fold_mid_phase))
        except FoldAbandoned:
            return bool(self.folded)  # θ was fetched again, or the run ended: the phase is dropped
        self.emulate_straggler(trained, round_)
        self.ahead = trained
        if self.folded is not None:
            return self.folded
        return self.fold_in()

    def fold_in(self) -> bool:
        """Round r's result (waited for) into θ; apply's answer."""
        self.finish_push()
        result, self.late = self.late, None
        if result is None:
            result = self.session.next_result(self.round)
        self.inflight = self.running = None
        return self.apply(result)

    def result_in(self, step: int) -> bool:
        """outer.fold_step "arrival", before inner ``step``: whether the result of the round
        in flight is wholly in (its frames' last byte), so that folding it waits for nothing.
        Once folded, true at that step alone: every partition of the phase moves there."""
        if self.fold_at is not None:
            return step == self.fold_at
        if self.late is None:
            self.late = self.session.poll_result(self.round)
        return self.late is not None and self.late.last_byte_at.done()

    def fold_mid_phase(self, step: int) -> list[Tensor]:
        """Before inner ``step`` of an overlapped phase (InnerTrainer's fold, at
        outer.fold_step): wait for the round in flight's result and fold it into θ, once; the
        phase then moves onto θ. A fold that leaves θ elsewhere than at the phase's round (a resync fetched
        the state, or the run ended) abandons the phase (FoldAbandoned): the next round is
        played the non-overlapped way."""
        if self.folded is None:
            start, self.fold_at = time.monotonic(), step
            self.folded = self.fold_in()
            self.fold_wait_s += time.monotonic() - start
            log.info("round %d's result folded in before inner step %d of round %d (waited %.2fs)",
                     self.folding - 1, step, self.folding, self.fold_wait_s)
        if self.folded or self.catching_up or self.round != self.folding:
            log.info("round %d's phase dropped at its fold: θ is at round %d", self.folding, self.round)
            raise FoldAbandoned(f"round {self.folding}'s phase dropped at its fold")
        return self.theta

    def finish_push(self) -> None:
        """Wait for the push thread's push (its Disconnected is raised here)."""
        pushing, self.pushing = self.pushing, None
        if pushing is not None:
            pushing.result()

    def take_ahead(self) -> Trained | None:
        """The inner phase of this round if it was trained before the previous result was in."""
        ahead, self.ahead = self.ahead, None
        return ahead if ahead is not None and ahead.round == self.round else None

    def drop_overlap(self) -> None:
        """Forget the round in flight (a reconnect or resync catches up by fetching the
        state): wait for its push to end, whatever its outcome."""
        pushing, self.pushing = self.pushing, None
        if pushing is not None:
            try:
                pushing.result()
            except Exception as exc:  # noqa: BLE001 - the round is dropped either way
                log.info("push of round %d ended with %s", self.inflight.round if self.inflight else -1, exc)
        self.inflight = self.running = self.ahead = self.late = None

    def confirm(self) -> bool:
        """Wait for the digest check of θ (if one runs). On a mismatch fetch the state again
        and return False; a stream that ended before the digest raises Disconnected (θ is
        then unconfirmed, so the reconnect fetches the state)."""
        check, self.check = self.check, None
        if check is None:
            return True
        try:
            ok = check.outcome()
        except Disconnected:
            self.task = None
            raise
        if not ok:
            self.counters.digest_mismatches += 1
            log.warning("round %d: digest mismatch (mine %s, coordinator %s)", check.header.round,
                        check.mine[:16], check.expected.result()[:16])
            self.resync(check.header)
        return ok

    def emulate_straggler(self, trained: Trained, round_: int | None = None) -> None:
        """A slower worker's extra compute, spent computing (the core stays busy)."""
        round_ = self.round if round_ is None else round_
        delay = self.training.straggler.extra_delay(round_, trained.compute_s)
        if delay > 0:
            log.info("round %d: straggler emulation computes %.2fs more", round_, delay)
            if not occupy(delay, self.stopping):
                raise Stopped("stop() was called")

    def encode(self, trained: Trained) -> Push:
        """The coded message of the task's partitions, encoded as this round's frame."""
        training = self.training
        message = training.message(self.task)
        self.density = training.encoder.set_density(training.density.choose(trained.compute_s))
        start = time.monotonic()
        frame = training.encoder.encode(message, self.round, self.session.worker_id)
        encode_s = time.monotonic() - start
        log.info("round %d: trained partitions %s in %.2fs, loss %.4f, frame %d bytes at density "
                 "%.5f (encoded in %.2fs)", self.round, trained.partitions, trained.compute_s,
                 trained.loss, len(frame), self.density, encode_s)
        return Push(self.round, frame, trained.compute_s, trained.loss, trained.partitions, encode_s,
                    self.apply_s, self.counters.digest_mismatches, self.counters.resyncs,
                    self.density, training.density.rate)

    def push(self, push: Push) -> None:
        """Send the frame (on the main thread, or the push thread under overlap) and time it
        for the link-aware density (geoloco.worker.density)."""
        start = time.monotonic()
        reply = self.session.push(push)
        self.training.density.observe(push.density, len(push.frame), time.monotonic() - start)
        if reply.accepted:
            self.counters.bytes_pushed += len(push.frame)
        else:
            self.counters.rejected_pushes += 1
            log.warning("round %d: coordinator rejected the frame: %s", push.round, reply.reason)

    def apply(self, result: RoundResult) -> bool:
        """Apply round r's result to θ_r, frame by frame as they are decoded, and start the
        digest check of θ_{r+1} beside the next round; True when the run is finished."""
        header = result.header
        if not self.confirm():
            return False  # θ was fetched again: it already holds this result
        if header.round > self.round:
            log.warning("round %d result arrived while at round %d; fetching state", header.round, self.round)
            return self.resync(header)
        self.task = None  # θ is between rounds until every frame is in
        try:
            self.apply_s = result.apply_to(self.theta) if self.training.state is None else self.apply_in_island(result)
        except FrameError as exc:
            log.error("round %d: bad frame in the round result (%s)", header.round, exc)
            return self.resync(header)
        self.counters.bytes_received += result.nbytes
        self.counters.rounds_applied += 1
        if self.outbox is not None and self.outbox.round == header.round:
            self.training.encoder.settle(header.settlement, self.outbox.frame, result.applied)
        log.info("round %d applied: %d frames from %s in %.2fs", header.round, len(header.frames),
                 list(header.arrived), self.apply_s)
        self.round, self.task, self.outbox = header.round + 1, header.next_task, None
        self.next_task = header.task_after_next if header.HasField("task_after_next") else None
        self.catching_up = False
        if self.training.state is None:
            self.check = DigestCheck(header, self.theta, result.digest)
        else:  # the island's ranks put θ together for it now
            self.check = DigestCheck(header, None, result.digest, mine=self.theta_digest())
        self.save_local_state()
        if header.finished:
            self.confirm()
        return header.finished

    def apply_in_island(self, result: RoundResult) -> float:
        """apply's apply in an fsdp island: once every frame is in and checked here, each rank
        decodes them and applies them to its pieces of θ (IslandState.apply). Returns the
        seconds from the last frame byte (or from now, if later) to θ updated."""
        header, start = result.header, time.monotonic()
        frames = result.all_frames()
        weights, mode = [f.weight for f in header.frames], header.aggregation or "sum"
        self.island.send("apply", result.data, weights, mode, header.alpha)
        self.training.state.apply(frames, weights, mode, header.alpha)
        return time.monotonic() - max(start, result.last_byte_at.result())

    def theta_digest(self) -> str:
        """param_digest(θ); in an fsdp island the ranks put θ together one tensor at a time."""
        state = self.training.state if self.training is not None else None
        if state is None:
            return param_digest(self.theta)
        self.island.send("digest")
        return state.digest()

    # ------------------------------------------------------------------ state and connection

    def resync(self, header: pb.RoundHeader) -> bool:
        """θ is not the coordinator's after ``header``'s round: count it and fetch the state
        again; True when that round finished the run."""
        self.counters.resyncs += 1
        self.task = None  # a reconnect must fetch the state
        if self.counters.resyncs > self.max_resyncs:
            raise RuntimeError(f"{self.counters.resyncs} resyncs: this replica keeps diverging from the coordinator")
        if not header.finished:
            self.fetch_state()
            return False
        try:
            self.fetch_state()
        except (Disconnected, RuntimeError) as exc:
            log.error("run finished but the final state could not be fetched: %s", exc)
        self.round = header.round + 1
        return True

    def fetch_state(self) -> None:
        self.load_state(self.session.fetch_state())

    def load_state(self, state: State) -> None:
        """θ ← the coordinator's parameters, checked against their digest; take the task of
        its open round."""
        self.release_check()
        if self.trained is not None and (state.round != self.round or state.digest != self.theta_digest()):
            self.trained = None  # trained from another θ
        self.drop_overlap()
        self.catching_up = self.catching_up or self.round >= 0  # not the first fetch: catch up
        layout = self.training.layout
        frame = decode_frame(state.data, layout)
        dense = ([t.view(spec.shape) for t, spec in zip(frame.dense, layout.specs, strict=True)]
                 if frame.kind == "dense" else frame.to_dense(torch.device("cpu")))  # views of the decoded frame
        del frame
        if self.training.state is not None:  # each rank of the island keeps its pieces
            self.island.send("load")
            self.training.state.load(dense)
            digest = param_digest(dense)
        else:
            for t, v in zip(self.theta, dense, strict=True):
                t.copy_(v.reshape(t.shape))
            digest = param_digest(self.theta)
        del dense
        if digest != state.digest:
            raise RuntimeError(f"state for round {state.round} has digest {digest}, coordinator says {state.digest}")
        self.round, self.task, self.outbox, self.apply_s = state.round, state.task, None, 0.0
        self.next_task = state.next_task
        self.counters.bytes_received += len(state.data)
        log.info("fetched state of round %d (%d bytes, digest %s)", state.round, len(state.data), digest[:16])

    def release_check(self) -> bool:
        """Before θ is replaced: stop checking it; True when it was confirmed (or nothing
        was pending)."""
        check, self.check = self.check, None
        return check is None or check.release()

    def connect(self) -> None:
        """Join (or rejoin with the same id), holding a starting stream (the worker is live
        meanwhile); fetch the state unless θ is confirmed and at the coordinator's open
        round; follow the Rounds stream from θ's round."""
        rejoining = self.session.worker_id is not None
        reply = self.join()
        self.session.keep_alive(reply.current_round)  # live while it starts, however slowly
        self.write_report("rejoined" if rejoining else "joined")
        if self.training is None:
            self.training = Training.from_join(reply, self.device, self.precision, self.inner_step,
                                               self.admission, self.island)
            if self.island is not None:  # the other ranks build the same trainer
                self.island.send("config", reply.run_config_json)
            if self.training.state is None:  # (an fsdp island's is in pieces, on every rank)
                # θ on huge pages: applying sparse rounds touches cache lines at random
                self.theta = on_huge_pages(self.training.trainer.master_copy())
            self.restore_local_state()
        if not self.release_check():
            self.task = None  # θ was never confirmed: fetch the state
        if self.inflight is not None or self.ahead is not None:
            self.drop_overlap()
            self.task = None  # a round was in flight: catch up from the coordinator's state
        # a coordinator ahead holds the results θ lacks (else the stream says Behind): they
        # are applied as they were broadcast, so this worker's own frame is settled too
        if reply.current_round < self.round or self.task is None:
            self.fetch_state()
        if self.run_over():
            log.info("all %d rounds of the run are closed (rejoined after the last one): the state "
                     "fetched is the final one", self.training.cfg.rounds)
            return
        self.session.follow(self.round, self.training.layout)

    def run_over(self) -> bool:
        """Whether θ is past the run's last round: a worker that rejoins after the last
        round closed (killed before it, started again after) fetches the final state and
        has no round left to play or result to wait for."""
        return self.training is not None and self.round >= self.training.cfg.rounds

    def join(self) -> pb.JoinReply:
        """Session.join; a new process first takes the identity saved in state_dir by a
        worker process that is gone, so it gets that slot back at once. An identity the
        coordinator refuses (its slot went to another worker, or another run) is dropped for
        a plain Join. Every Join's identity is saved for the next restart."""
        device = self.describe_device()
        claimed = self.identities.claim() if self.identities and self.session.worker_id is None else None
        if claimed is not None:
            log.info("reclaiming worker %d, the identity saved in %s", claimed[0], self.state_dir)
            self.session.worker_id, self.session.secret = claimed
        try:
            reply = self.session.join(device)
        except JoinRefused as exc:
            if claimed is None or exc.code != "UNAUTHENTICATED":
                raise
            log.warning("the saved identity of worker %d was refused (%s); joining as a new worker",
                        claimed[0], exc)
            self.identities.forget(claimed[0])
            self.session.worker_id, self.session.secret = None, ""
            reply = self.session.join(device)
        if self.identities is not None:
            self.identities.save(reply.worker_id, reply.session)
        return reply

    def restore_local_state(self) -> None:
        """After the first Join: the state this worker id saved in state_dir, if any; else
        the error feedback starts from zero, and the log says so."""
        if self.state_dir is None:
            return
        path = local_state.state_path(self.state_dir, self.session.worker_id)
        if not path.exists():
            log.warning("no local state of worker %d in %s: error feedback and inner AdamW "
                        "state start from zero", self.session.worker_id, self.state_dir)
            return
        try:
            saved_at, adamw = local_state.load(path, self.training)
        except LocalStateError as exc:
            log.warning("%s: error feedback and inner AdamW state start from zero", exc)
            return
        self.catching_up = True  # a resumed worker plays its first round without overlap
        island, trainer = self.island, self.training.trainer
        if island is not None and island.sharded:  # each rank restores its own shard, or none does
            island.send("restore", str(path), saved_at, self.training.layout.digest.hex())
            adamw = restore_shards(island, trainer, adamw, self.training.state)
        elif island is not None and adamw:  # every rank steps AdamW from the same state
            island.send("optimizer", cpu_state(trainer.optimizer.state_dict()))
        log.info("restored the local state of round %d from %s (error feedback, %sdata positions)",
                 saved_at, path, "inner AdamW state, " if adamw else "")

    def save_local_state(self) -> None:
        """Between rounds, every state_every rounds (None: every round while a save costs
        under STATE_COST_SHARE of a round, else as rarely as keeps it so): the worker's own
        state to state_dir, copied here and written on the StateWriter's thread (a measured
        cadence skips a round whose save finds the write before it still going); a failed
        write is logged and training goes on."""
        start = time.monotonic()
        round_s = start - self.applied_at if self.applied_at is not None else None
        self.applied_at = start
        if self.state_dir is None:
            return
        if self.state_every is None and self.state_writer.busy:
            return
        self.settle_state_write()
        every = self.state_interval if self.state_every is None else self.state_every
        if not every or self.round - self.state_saved_round < every:
            return
        path = local_state.state_path(self.state_dir, self.session.worker_id)
        island = self.island
        if island is not None and island.sharded:  # the other ranks' AdamW shards first
            island.send("save", str(path), self.round, self.training.layout.digest.hex())
            if not island.agree(True):
                log.error("a rank of the island did not write its AdamW shard of round %d: the local "
                          "state stays at round %d; training goes on", self.round, self.state_saved_round)
                return
        state = local_state.snapshot(self.training, self.round)
        self.state_write = (path, self.round, time.monotonic() - start, round_s)
        self.state_writer.submit(path, state)

    def settle_state_write(self) -> None:
        """The outcome of the local state write in flight, waited for: the round saved, the
        measured cadence (copy and write against the round), the log line."""
        if not self.state_writer.pending:
            return
        path, round_, copy_s, round_s = self.state_write
        try:
            save_s = copy_s + (self.state_writer.outcome() or 0.0)
        except OSError as exc:
            log.error("local state of round %d not written to %s (%s); training goes on",
                      round_, path, exc.strerror or exc)
            return
        self.state_saved_round = round_
        if self.state_every is None and round_s:
            self.state_interval = max(1, math.ceil(save_s / (STATE_COST_SHARE * round_s)))
        log.info("local state of round %d saved in %.3fs (%s; %.3fs between rounds); next in %d rounds", round_,
                 save_s, f"{save_s / round_s:.1%} of a round" if round_s else "first", copy_s,
                 self.state_every if self.state_every is not None else self.state_interval)

    def reconnect(self, reason: str) -> None:
        """Rejoin with the same id, retrying until connect_timeout_s (Join itself backs off
        while the coordinator is unreachable)."""
        if self.stopping.is_set():
            raise Stopped(reason)
        log.warning("connection lost (%s); rejoining as worker %s", reason, self.session.worker_id)
        self.counters.reconnects += 1
        deadline = time.monotonic() + self.session.connect_timeout_s
        while True:
            try:
                self.connect()
                return
            except Disconnected as exc:
                if self.stopping.is_set():
                    raise Stopped(str(exc)) from None
                if time.monotonic() > deadline:
                    raise CoordinatorUnreachable(f"could not resume with {self.session.address}: {exc}") from None
                log.warning("rejoin incomplete (%s); retrying in %.1fs", exc, transport.BACKOFF_START_S)
                time.sleep(transport.BACKOFF_START_S)

    def finish(self) -> None:
        island = self.island
        if island is not None and island.sharded and self.training is not None:
            island.send("shards")  # what each rank holds, for the report
            trainer = self.training.trainer
            self.held = {"params": island.shard_sizes(trainer.params),
                         "adamw": island.shard_sizes(optimizer_tensors(trainer.optimizer))}
            state = self.training.state
            self.held["theta"] = island.counts(state.held)
            if state.shard is not None:
                self.held["error_feedback"] = island.counts(state.shard.held)
        digest = self.theta_digest()
        log.info("run finished after round %d: final digest %s, %d resyncs, %d reconnects",
                 self.round - 1, digest, self.counters.resyncs, self.counters.reconnects)
        self.write_report("finished", digest=digest)
        self.close()

    def describe_device(self) -> str:
        """As reported at Join: ``cpu``, ``cuda:0 (NVIDIA H200)``, with the island's ranks."""
        device = describe_device(self.device)
        return device if self.island is None else f"{device}, {self.island.describe()}"

    def close(self) -> None:
        self.session.close()
        self._pusher.shutdown(wait=True)
        self.settle_state_write()  # the last local state, whole on disk before the process ends
        self.state_writer.close()

    def write_report(self, status: str, digest: str | None = None) -> None:
        """worker-<id>.json in the report folder: id, pid, status, digest, counters; the
        launcher reads it (written atomically)."""
        if self.report_dir is None or self.session.worker_id is None:
            return
        report = {"worker_id": self.session.worker_id, "status": status,
                  # the process to signal: an island's launcher (geoloco.worker.island.launch)
                  "pid": os.getpid() if self.island is None else int(os.environ.get(LAUNCHER_PID_ENV, os.getpid())),
                  "device": self.describe_device(), "round": self.round, "digest": digest,
                  **asdict(self.counters)}
        if self.island is not None:
            report["island"] = {"ranks": self.island.size, "parallel": self.island.parallel,
                                "rank0_pid": os.getpid()}
            if self.held is not None:  # fsdp: each rank's elements of the model and of AdamW's moments
                report["island"]["held"] = self.held
        path = Path(self.report_dir) / f"worker-{self.session.worker_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(report, indent=2), durable=False)


def restore_shards(island: Island, trainer: InnerTrainer, loaded: bool, state: IslandState) -> bool:
    """Every rank of an fsdp island after ``restore``: whether each restored its shards of
    the AdamW state, of the partitions' latest Δ and (SparseLoCo) of the error feedback
    (``loaded``: this rank's outcome); where one did not, every rank starts them all from
    zero, so that no shard steps from a state the others lack."""
    if island.agree(loaded):
        return True
    trainer.optimizer.state.clear()
    state.reset()
    if state.shard is not None:
        state.shard.reset()
    if island.leader:
        log.warning("a rank of the island has no shard of that round: the island's inner AdamW state, "
                    "error feedback and partitions' latest pseudo-gradients start from zero")
    return False
