"""Straggler emulation: seeded per-worker models of the extra delay a round suffers.

The models follow the straggler literature that gradient coding is evaluated against
(Tandon, Lei, Dimakis and Karampatziakis 2017, "Gradient Coding"; Krishnan, Ebrahimi
and Khisti 2023, "Sequential Gradient Coding for Straggler Mitigation"): a fixed slow-down factor, a shifted
exponential delay, a two-state bursty Markov chain, and a replayed recorded trace.

Profiles are strings (config and CLI), parsed by ``geoloco.profiles.parse_straggler_profile``::

    none                           no extra delay
    fixed:F                        extra = (F - 1) * compute            F >= 1
    exp:T0:MEAN                    extra = T0 + Exp(MEAN) seconds       T0, MEAN >= 0
    markov:P_SLOW:P_FAST:F         bursty: fast->slow with P_SLOW, slow->fast with P_FAST,
                                   extra = (F - 1) * compute while slow
    blocks:F:K                     extra = (F - 1) * compute in rounds K..2K-1, 3K..4K-1, ...
                                   (none in the others: a run measures both side by side)
    trace:PATH                     replay row worker_id of an n x rounds table (CSV or JSON)
                                   of extra seconds, cyclically past its last round

Every draw is a function of (seed, worker_id, round index) only, so a model answers the same
for the same round whatever order rounds are asked in. The worker spends the extra time
computing (``occupy``), so an emulated straggler keeps its core busy as a slower worker's
compute would, rather than freeing it for the others on a shared machine.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from geoloco.profiles import load_trace_row, parse_straggler_profile


class StragglerModel(ABC):
    """Extra delay (seconds) a worker adds to a round, given the round's compute time."""

    @abstractmethod
    def extra_delay(self, round_index: int, compute_s: float) -> float:
        """Seconds to wait after computing round ``round_index`` that took ``compute_s`` seconds."""


class NoStragglers(StragglerModel):
    def extra_delay(self, round_index: int, compute_s: float) -> float:
        return 0.0


@dataclass(frozen=True)
class FixedSlowdown(StragglerModel):
    """A worker ``factor`` times slower than it is: extra = (factor - 1) * compute."""

    factor: float

    def extra_delay(self, round_index: int, compute_s: float) -> float:
        return (self.factor - 1.0) * compute_s


@dataclass(frozen=True)
class ShiftedExponential(StragglerModel):
    """extra = t0 + Exp(mean), drawn afresh each round (mean 0: always t0)."""

    t0: float
    mean: float
    worker_id: int
    seed: int

    def extra_delay(self, round_index: int, compute_s: float) -> float:
        rng = _round_rng(self.seed, self.worker_id, round_index)
        return self.t0 + (rng.exponential(self.mean) if self.mean > 0 else 0.0)


class MarkovBursty(StragglerModel):
    """Two-state chain (fast, slow) advanced once per round; slow rounds take ``factor``
    times their compute. Round 0 starts from the stationary law, so the slow fraction is
    p_slow / (p_slow + p_fast) from the first round on (always fast if both are 0)."""

    def __init__(self, p_slow: float, p_fast: float, factor: float, worker_id: int, seed: int):
        self.p_slow, self.p_fast, self.factor = p_slow, p_fast, factor
        self.worker_id, self.seed = worker_id, seed
        self._slow: list[bool] = []

    @property
    def stationary_slow(self) -> float:
        total = self.p_slow + self.p_fast
        return self.p_slow / total if total > 0 else 0.0

    def is_slow(self, round_index: int) -> bool:
        if round_index < 0:
            raise ValueError(f"round_index must be >= 0, got {round_index}")
        while len(self._slow) <= round_index:
            self._slow.append(self._next_state(len(self._slow)))
        return self._slow[round_index]

    def _next_state(self, t: int) -> bool:
        u = _round_rng(self.seed, self.worker_id, t).random()
        if t == 0:
            return u < self.stationary_slow
        if self._slow[t - 1]:
            return u >= self.p_fast
        return u < self.p_slow

    def extra_delay(self, round_index: int, compute_s: float) -> float:
        return (self.factor - 1.0) * compute_s if self.is_slow(round_index) else 0.0


@dataclass(frozen=True)
class SlowBlocks(StragglerModel):
    """``factor`` times slower in every other block of ``rounds`` rounds (the second, the
    fourth, ...), as fast as the others in the rest."""

    factor: float
    rounds: int

    def is_slow(self, round_index: int) -> bool:
        return (round_index // self.rounds) % 2 == 1

    def extra_delay(self, round_index: int, compute_s: float) -> float:
        return (self.factor - 1.0) * compute_s if self.is_slow(round_index) else 0.0


@dataclass(frozen=True)
class TraceReplay(StragglerModel):
    """Replays one worker's row of a recorded delay table, cyclically past its end."""

    delays: tuple[float, ...]

    def extra_delay(self, round_index: int, compute_s: float) -> float:
        if round_index < 0:
            raise ValueError(f"round_index must be >= 0, got {round_index}")
        return self.delays[round_index % len(self.delays)]


def make_straggler(profile: str, worker_id: int, seed: int) -> StragglerModel:
    """The straggler model of ``profile`` for one worker, deterministic given ``seed``."""
    if worker_id < 0 or seed < 0:
        raise ValueError(f"worker_id and seed must be >= 0, got worker_id={worker_id}, seed={seed}")
    parsed = parse_straggler_profile(profile)
    p = parsed.params
    if parsed.kind == "fixed":
        return FixedSlowdown(p[0])
    if parsed.kind == "exp":
        return ShiftedExponential(p[0], p[1], worker_id, seed)
    if parsed.kind == "markov":
        return MarkovBursty(p[0], p[1], p[2], worker_id, seed)
    if parsed.kind == "blocks":
        return SlowBlocks(p[0], int(p[1]))
    if parsed.kind == "trace":
        return TraceReplay(tuple(load_trace_row(parsed.path, worker_id)))
    return NoStragglers()


OCCUPY_SIDE = 64  # the busy loop multiplies 64 x 64 matrices: a few microseconds each


def occupy(seconds: float, stop: threading.Event | None = None) -> bool:
    """Keep this thread computing for ``seconds`` of wall time (small matrix products), as
    the extra compute of a slower worker would: the core stays busy, so the other workers
    on a shared machine do not get it (a sleep would hand it to them). False when ``stop``
    was set first."""
    end = time.monotonic() + seconds
    a = torch.ones(OCCUPY_SIDE, OCCUPY_SIDE)
    b = torch.empty_like(a)
    while time.monotonic() < end:
        if stop is not None and stop.is_set():
            return False
        torch.mm(a, a, out=b)
    return True


def _round_rng(seed: int, worker_id: int, round_index: int) -> np.random.Generator:
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    return np.random.default_rng([seed, worker_id, round_index])
