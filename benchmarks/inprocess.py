"""One training run of the round protocol in one process, for the loss benchmarks: the
real inner trainer, latest-delta buffers, frame encoder, close policy, outer step, apply
and error-feedback settlement, without processes, gRPC or links. For a run whose rounds
close the same way it gives the same parameters, bit for bit, as ``geoloco local``
(tests/integration/test_inprocess.py checks it), in a fraction of the time: the workers
train one after the other on one core, nothing waits for anything.

Which workers straggle is a rule, not a clock: ``stragglers(round)`` names the workers
whose frames arrive last that round; the others arrive in worker-id order and the round
closes at the first decodable prefix (every straggler still trains and encodes, as a
slow worker would, and then settles its frame by the round header).

The validation loss is scored after the last ``val_tail`` rounds (every round with
``val_every_round``); ``Result.tail_val_loss``, their mean, is what the loss benchmarks
report: one round's loss moves by more than the differences they look for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from geoloco.compression import Layout, decode_frame
from geoloco.config import FOLD_ARRIVAL, RunConfig
from geoloco.coordinator.gradient_coding import GradientCode, make_code
from geoloco.coordinator.outer import Update, apply_update, make_outer
from geoloco.coordinator.rounds import (
    Arrival,
    ClosePolicy,
    Decision,
    QuorumPolicy,
    close_policy,
    worker_task,
)
from geoloco.replica import param_digest
from geoloco.tasks import build_task
from geoloco.worker.encoder import FrameEncoder
from geoloco.worker.overlap import running_copy, standin_scale
from geoloco.worker.partitions import LatestDeltas
from geoloco.worker.trainer import Fold, InnerTrainer

Stragglers = Callable[[int], list[int]]
VAL_TAIL = 5  # rounds at the end whose validation losses are averaged


@dataclass
class Result:
    """What one run measured: validation losses (after the rounds ``val_rounds``), bytes
    and the digest."""

    val_losses: list[float] = field(default_factory=list)
    val_rounds: list[int] = field(default_factory=list)
    upload_bytes: list[int] = field(default_factory=list)  # per round, mean over the workers
    modes: list[str] = field(default_factory=list)  # apply_frames mode of each round's update
    digest: str = ""

    @property
    def final_val_loss(self) -> float:
        """The loss after the last round (what ``geoloco local`` reports)."""
        return self.val_losses[-1]

    def tail_val_loss(self, tail: int = VAL_TAIL) -> float:
        """The mean validation loss of the last ``tail`` rounds (fewer if the run has fewer)."""
        last = self.val_losses[-tail:]
        return sum(last) / len(last)


def no_stragglers(round_: int) -> list[int]:
    return []


def random_stragglers(n: int, s: int, seed: int) -> Stragglers:
    """s workers drawn afresh each round from (seed, round)."""
    def draw(round_: int) -> list[int]:
        return sorted(int(i) for i in np.random.default_rng([seed, round_]).choice(n, size=s, replace=False))
    return draw


@dataclass
class SimWorker:
    trainer: InnerTrainer
    encoder: FrameEncoder
    deltas: LatestDeltas = field(default_factory=LatestDeltas)


def close(policy: ClosePolicy, order: list[int], late: Iterable[int] = ()) -> Decision:
    """The decision at the first arrival that makes the set decodable. A quorum round
    (QuorumPolicy, which decides on time) takes every worker not ``late`` if they are a
    quorum (the late ones missed the grace window), else it waits for all."""
    if isinstance(policy, QuorumPolicy):
        on_time = sorted(set(order) - set(late))
        if len(on_time) >= policy.quorum:
            return policy.mean(on_time, "all arrived" if len(on_time) == len(order) else "quorum")
        return policy.mean(sorted(order), "all arrived")
    for k in range(1, len(order) + 1):
        decision = policy.decide(sorted(order[:k]), deadline_passed=False)
        if decision is not None:
            return decision
    raise RuntimeError(f"arrival order {order} never decodes")


Play = Callable[[int], tuple[bytes, list[int]]]  # worker i trains and encodes its round now


class Clock(Protocol):
    """Closes rounds by time instead of by the ``stragglers`` rule (benchmarks.simclock),
    and says which workers train each round: a worker that has the round's result before it
    starts skips the round, as a real worker does."""

    def close(self, round_: int, policy: ClosePolicy, play: Play) -> Decision:
        """The decision of round ``round_``; ``play(i)`` for every worker that starts the
        round before it closes, in the order they start."""

    def published(self, update: Update, play: Play) -> None:
        """The round is published with ``update``; ``play(i)`` for every worker that starts
        the round after the close but before the result reaches it (θ is still the
        round's)."""

    def over(self) -> bool:
        """True once the run ends before cfg.rounds (a time budget spent)."""


def simulate(cfg: RunConfig, stragglers: Stragglers = no_stragglers, code: GradientCode | None = None,
             val_every_round: bool = False, val_tail: int = VAL_TAIL, clock: Clock | None = None) -> Result:
    """Train ``cfg`` for cfg.rounds rounds; ``code`` overrides the one cfg.coding names;
    the validation loss is scored after each of the last ``val_tail`` rounds. One torch
    thread, as each process of ``geoloco local`` has (more threads change the rounding of
    the inner loop). There is no frame guard (coordinator.bounds): no frame is clipped or
    rejected, as in a run whose guard never fires. A ``clock`` closes each round instead
    of ``stragglers``, and may end the run sooner (``Clock.over``)."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
    model = task.make_model().to("cpu", torch.float32)
    params = [p.data for p in model.parameters()]
    layout = Layout.from_named_tensors(model.named_parameters())
    code = code or make_code(cfg.coding.scheme, cfg.workers, cfg.coding.tolerance(cfg.workers), cfg.coding.seed)
    policy = close_policy(code, cfg.coding)
    outer = make_outer(cfg, layout)
    undoable = cfg.coding.scheme != "none"
    workers = [SimWorker(InnerTrainer(task, cfg.inner, cfg.rounds, torch.device("cpu")),
                         FrameEncoder(layout, cfg.compression, undoable=undoable)) for _ in range(cfg.workers)]
    result = Result()
    for t in range(cfg.rounds):
        frames: dict[int, bytes] = {}

        def play_worker(i: int, t: int = t, frames: dict[int, bytes] = frames) -> tuple[bytes, list[int]]:
            frame, trained = play(workers[i], params, worker_task(code, i, t, cfg.rounds), t, i)
            frames[i] = frame
            return frame, trained

        if clock is not None:
            decision = clock.close(t, policy, play_worker)
        else:
            for i in range(cfg.workers):
                play_worker(i)
            late = stragglers(t)
            decision = close(policy, [i for i in range(cfg.workers) if i not in late] + late, late)
        arrivals = {i: Arrival(i, frames[i], decode_frame(frames[i], layout)) for i in decision.coefficients}
        chosen = [(arrivals[i], a) for i, a in sorted(decision.coefficients.items())]
        update = outer.step(t, chosen, decision)
        if clock is not None:
            clock.published(update, play_worker)
        apply_update(params, update)
        applied = [f.frame for f in update.frames]
        for i, frame in sorted(frames.items()):  # a worker that skipped the round has none
            workers[i].encoder.settle(policy.settlement(decision, i), frame, applied)
        result.upload_bytes.append(sum(len(f) for f in frames.values()) // cfg.workers)
        result.modes.append(update.mode)
        if val_every_round or t >= cfg.rounds - val_tail:
            result.val_losses.append(task.val_loss(model))
            result.val_rounds.append(t)
        if clock is not None and clock.over():
            break
    result.digest = param_digest(params)
    return result


def play(worker: SimWorker, theta: list[torch.Tensor], task, t: int, sender: int) -> tuple[bytes, list[int]]:
    """One worker's round, as worker.loop.Worker plays it: train, combine, encode; the
    frame and the partitions it trained."""
    trained = train_round(worker, theta, task, t)
    return worker.encoder.encode(worker.deltas.message(task), t, sender), trained


def simulate_overlap(cfg: RunConfig, stragglers: Stragglers = no_stragglers,
                     val_every_round: bool = False, densities: list[float] | None = None,
                     val_tail: int = 1, fold_steps: dict[tuple[int, int], int | None] | None = None) -> Result:
    """``simulate`` under cfg.outer.overlap, in the order an overlapping worker
    (geoloco.worker.loop.Worker.fold_late) does things: round t trains from the running
    copy set up when round t - 1 was pushed, then round t - 1's result is folded into the
    global track and its frame settled, then round t is encoded and the next running copy
    made (geoloco.worker.overlap); the last round's result is applied at the end. Overlap
    ``none`` folds each result before the next round trains (the same as ``simulate``).
    ``densities``: each worker's fixed top-k density (what compression.density "auto"
    chose in a real run), else cfg.compression.density. The validation loss is scored after
    each of the last ``val_tail`` results (every result with ``val_every_round``).
    Under cfg.outer.fold_step k the late result is folded in before inner step k of the
    next phase, and every worker's phase moves on from the global track with the steps it
    took so far (InnerTrainer's ``fold``), as Worker.fold_mid_phase does. Under
    fold_step "arrival" the step depends on when each result came: ``fold_steps`` gives it
    per (worker, round), as a real run's workers logged it (None: at the phase's end)."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
    model = task.make_model().to("cpu", torch.float32)
    params = [p.data for p in model.parameters()]
    layout = Layout.from_named_tensors(model.named_parameters())
    code = make_code(cfg.coding.scheme, cfg.workers, cfg.coding.tolerance(cfg.workers), cfg.coding.seed)
    policy = close_policy(code, cfg.coding)
    outer = make_outer(cfg, layout)
    workers = [SimWorker(InnerTrainer(task, cfg.inner, cfg.rounds, torch.device("cpu")),
                         FrameEncoder(layout, cfg.compression, undoable=cfg.coding.scheme != "none",
                                      density=densities[i] if densities else None))
               for i in range(cfg.workers)]
    mode, fold_step = cfg.outer.overlap, cfg.outer.fold_step
    if fold_step == FOLD_ARRIVAL and fold_steps is None:
        raise ValueError("outer.fold_step 'arrival' folds where each result came in: give the steps a real "
                         "run's workers folded at (fold_steps), or a fixed fold step")
    running = [params] * cfg.workers
    pending: tuple | None = None  # (decision, update, frames) of the round in flight
    result = Result()
    for t in range(cfg.rounds):
        if pending is not None and mode == "none":
            fold(params, policy, workers, *pending)
            pending = None
        tasks = [worker_task(code, i, t, cfg.rounds) for i in range(cfg.workers)]
        late = fold_once(params, policy, workers, pending) if pending is not None else None
        steps = [fold_step if fold_step != FOLD_ARRIVAL else fold_steps.get((i, t)) for i in range(cfg.workers)]
        trained = [train_round(w, running[i], tasks[i], t, None if late is None or steps[i] is None else (steps[i], late))
                   for i, w in enumerate(workers)]
        if late is not None:
            late(None)  # folded at the phases' end if no phase folded it mid-way
        frames = [w.encoder.encode(w.deltas.message(tasks[i]), t, i) for i, w in enumerate(workers)]
        if mode != "none":
            running = [running_copy(mode, params, [w.deltas.latest[p] for p in trained[i]],
                                    standin_scale(cfg, len(trained[i])), copy=fold_step is not None)
                       for i, w in enumerate(workers)]
        late = stragglers(t)
        decision = close(policy, [i for i in range(cfg.workers) if i not in late] + late, late)
        arrivals = {i: Arrival(i, frames[i], decode_frame(frames[i], layout)) for i in decision.coefficients}
        update = outer.step(t, [(arrivals[i], a) for i, a in sorted(decision.coefficients.items())], decision)
        pending = (decision, update, frames)
        result.upload_bytes.append(sum(len(f) for f in frames) // cfg.workers)
        result.modes.append(update.mode)
        if t > 0 and (val_every_round or t > cfg.rounds - val_tail):
            result.val_losses.append(task.val_loss(model))  # after round t - 1's result
    fold(params, policy, workers, *pending)
    result.val_losses.append(task.val_loss(model))
    result.digest = param_digest(params)
    return result


def train_round(worker: SimWorker, theta: list[torch.Tensor], task, t: int,
                late_in: Fold | None = None) -> list[int]:
    """One worker's inner phase of round ``t`` from ``theta``: the partitions it trained.
    ``late_in``: InnerTrainer.train_partition's ``fold``."""
    partitions = worker.deltas.to_train(task)
    for p in partitions:
        delta, _ = worker.trainer.train_partition(theta, p, t, fold=late_in)
        worker.deltas.keep(p, delta)
    return partitions


def fold_once(params: list[torch.Tensor], policy: ClosePolicy, workers: list[SimWorker],
              pending: tuple) -> Callable[[int | None], list[torch.Tensor]]:
    """The global track after ``pending`` is folded in, folding it at the first call: the
    mid-phase fold of every worker's phase (cfg.outer.fold_step; InnerTrainer's new start,
    called with the step), or the fold after the phases (None)."""
    folded = []

    def global_track(step: int | None) -> list[torch.Tensor]:
        if not folded:
            fold(params, policy, workers, *pending)
            folded.append(True)
        return params
    return global_track


def fold(params: list[torch.Tensor], policy: ClosePolicy, workers: list[SimWorker], decision: Decision,
         update, frames: list[bytes]) -> None:
    """A round's result into the global track, and every worker's frame settled by it."""
    apply_update(params, update)
    applied = [f.frame for f in update.frames]
    for i, w in enumerate(workers):
        w.encoder.settle(policy.settlement(decision, i), frames[i], applied)
