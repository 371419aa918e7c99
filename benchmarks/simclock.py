"""The round protocol on a simulated clock: ``benchmarks.inprocess.simulate`` (the real
trainer, encoder, close policy, outer step and settlement) with each round closed at the
time the run's close policy would close it, and no real time passing. It answers what real
processes on 2 cores cannot: loss against wall time for a scheme at n = 32 .. 256.

The time model, for round t on the coordinator's clock (the round opens when round t - 1's
result is published; round 0 opens at 0, when every worker has its state):

- worker i starts round t once it has round t - 1's result (publish time + the result's
  bytes over its link + the link's one-way delay) and has finished its own push of round
  t - 1 (a late push still takes its link). As ``geoloco.worker.loop.Worker.play_round``
  does, a worker that already holds round t's result when it starts skips round t (it
  trains nothing and catches up), and one whose result comes while it computes does not
  push;
- it computes ``compute_s`` per partition it trains that round (pipelined codes train one,
  classic codes s + 1), then its straggler model's extra delay
  (``geoloco.worker.stragglers.make_straggler`` of the run's ``stragglers.*`` profiles,
  seeded as a real worker seeds it), then ``work_s`` (encode and apply);
- its frame arrives after its bytes over its link rate plus the one-way delay (the run's
  ``network.*`` link profiles; jitter and loss are not modelled);
- the round closes at the first moment (an arrival, the end of a quorum's grace window,
  the deadline) at which the policy, asked with the arrival times so far, decides: the
  policy object the coordinator runs (``close_policy``), which also learns from each
  closed round's times as the coordinator's does (``observe``);
- the result is published ``close_s`` after the decision (the coordinator's close; 0 by
  default: it is alike for every scheme).

Frame and result bytes are the real ones of the run's model; the compute time is a
parameter, so one figure stands for a GPU's inner phase as well as a CPU's. A run is a
function of its config and ``compute_s``: the same inputs give the same times, decisions
and parameters (tests/integration/test_simclock.py).

The comparison runs ``none`` for --rounds rounds, then every other scheme of the same seed
until its clock passes ``none``'s end, all on one learning-rate schedule of SCHEDULE x
--rounds rounds: a scheme that closes rounds sooner plays more of them in the same time.
Loss at equal wall time is read at the earliest end; loss at equal tokens at the fewest
inner phases trained (a classic code trains s + 1 partitions a round, so it reaches them
in fewer rounds). The default model is gpt-nano, so that n = 8 and n = 256 run the same
model; its frames are small, so the links' share of a round is small and the stragglers'
compute sets the times.

    python -m benchmarks.simclock --quick            # n = 4, two schemes, a few rounds
    python -m benchmarks.simclock                    # n = 8, 32, 5 seeds, 2 straggler models
    python -m benchmarks.simclock --n 128 --seeds 2                 # the large n
    python -m benchmarks.simclock --validate         # real local runs at n = 4, 8 beside their simulations
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.inprocess import Play, simulate
from benchmarks.island import interval
from benchmarks.parity import upper95
from benchmarks.provenance import provenance
from geoloco.config import LATE_WORK, RunConfig, load_config
from geoloco.coordinator.outer import Update
from geoloco.coordinator.rounds import ArrivalTimes, ClosePolicy, Decision, QuorumPolicy
from geoloco.profiles import LinkProfile
from geoloco.worker.stragglers import StragglerModel, make_straggler

SCHEMES = ("none", "ignore", "quorum", "pgc-fr", "gc-fr")
# an instant after a grace window ends: the policy compares now - quorum_at >= grace, and
# the float sum quorum_at + grace can round below it
GRACE_EPSILON = 1e-9


def transfer_s(nbytes: int, link: LinkProfile) -> float:
    """Seconds for ``nbytes`` to cross ``link``: serialization at its rate plus its one-way delay."""
    return (8.0 * nbytes / link.rate_bps if link.rate_bps else 0.0) + link.delay_s


START, ARRIVAL, WINDOW, DEADLINE = range(4)  # event kinds, in the order ties are taken


@dataclass
class ClockedRound:
    """One round on the simulated clock: when it opened and closed (seconds since the run
    began), the chosen workers, why it closed, when each frame came that the close saw
    (seconds since the open), each worker's compute (seconds per partition x partitions;
    only the workers that trained), and the workers that skipped the round."""

    round: int
    opened_at: float
    closed_at: float
    chosen: list[int]
    reason: str
    arrivals: dict[int, float]
    compute_s: dict[int, float] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)


class SimClock:
    """The clock of one run (``benchmarks.inprocess.Clock``): the time model of this
    module's docstring over ``cfg``'s links, straggler profiles and deadline. Each round is
    an event loop (workers starting, frames arriving, a quorum's window ending, the
    deadline), in time order, until the policy decides."""

    def __init__(self, cfg: RunConfig, compute_s: float, work_s: float = 0.0, close_s: float = 0.0,
                 until: float | None = None, max_rounds: int | None = None) -> None:
        if cfg.outer.overlap != "none":
            raise ValueError(f"simclock models outer.overlap 'none' only, not {cfg.outer.overlap!r}")
        if compute_s <= 0 or work_s < 0 or close_s < 0:
            raise ValueError(f"compute_s must be > 0, work_s and close_s >= 0; got {compute_s}, {work_s}, {close_s}")
        n = cfg.workers
        self.compute_s, self.work_s, self.close_s = compute_s, work_s, close_s
        self.deadline_s = cfg.coordinator.deadline_s
        self.links = [cfg.network.profile_for(i) for i in range(n)]
        self.stragglers: list[StragglerModel] = [make_straggler(cfg.stragglers.profile_for(i), i, cfg.seed)
                                                 for i in range(n)]
        self.ready_at = [0.0] * n  # when each worker starts its next round
        self.done_at: dict[int, float] = {}  # this round: when a worker's frame was encoded
        self.pushed_at: dict[int, float] = {}  # ... and when its push was through
        self.opened_at = 0.0
        self.rounds: list[ClockedRound] = []
        self.until, self.max_rounds = until, max_rounds  # the run ends at either (over)

    def close(self, round_: int, policy: ClosePolicy, play: Play) -> Decision:
        self.done_at, self.pushed_at = {}, {}
        current = ClockedRound(round_, self.opened_at, self.opened_at, [], "", {})
        events = [(ready, START, i) for i, ready in enumerate(self.ready_at)]
        events.append((self.opened_at + self.deadline_s, DEADLINE, -1))
        heapq.heapify(events)
        while True:
            at, kind, i = heapq.heappop(events)
            if kind == START:
                heapq.heappush(events, (self.train(round_, i, play, current), ARRIVAL, i))
                continue
            if kind == ARRIVAL:
                current.arrivals[i] = at - self.opened_at
                window = self.window_end(policy, current.arrivals)
                if window is not None:
                    heapq.heappush(events, (self.opened_at + window, WINDOW, -1))
            now = at - self.opened_at
            decision = policy.decide(sorted(current.arrivals), kind == DEADLINE,
                                     ArrivalTimes(now, dict(current.arrivals)))
            if decision is not None:
                break
        policy.observe(ArrivalTimes(now, dict(current.arrivals)))
        current.closed_at = at + self.close_s  # published
        current.chosen, current.reason = sorted(decision.coefficients), decision.reason
        self.rounds.append(current)
        return decision

    def published(self, update: Update, play: Play) -> None:
        current = self.rounds[-1]
        nbytes = sum(len(f.data) for f in update.frames)
        for i, link in enumerate(self.links):
            has_result = current.closed_at + transfer_s(nbytes, link)
            if i not in self.done_at:  # not started by the close
                if self.ready_at[i] >= has_result:  # the result is in: the round is skipped
                    current.skipped.append(i)
                    continue
                self.train(current.round, i, play, current)
            if self.done_at[i] >= has_result:  # the result came first: nothing pushed
                self.ready_at[i] = self.done_at[i]
            else:
                self.ready_at[i] = max(self.pushed_at[i], has_result)
        self.opened_at = current.closed_at

    def over(self) -> bool:
        """The run has spent its time budget (a round closed at or after ``until``) or
        played ``max_rounds`` rounds."""
        return ((self.until is not None and self.rounds[-1].closed_at >= self.until)
                or (self.max_rounds is not None and len(self.rounds) >= self.max_rounds))

    def train(self, round_: int, i: int, play: Play, current: ClockedRound) -> float:
        """Worker i plays its round from ready_at[i]: when its push is through."""
        frame, trained = play(i)
        compute = current.compute_s[i] = self.compute_s * len(trained)
        self.done_at[i] = (self.ready_at[i] + compute + self.stragglers[i].extra_delay(round_, compute)
                           + self.work_s)
        self.pushed_at[i] = self.done_at[i] + transfer_s(len(frame), self.links[i])
        return self.pushed_at[i]

    @staticmethod
    def window_end(policy: ClosePolicy, arrivals: dict[int, float]) -> float | None:
        """A quorum policy's grace window end (since the open) once a quorum is in."""
        if not isinstance(policy, QuorumPolicy) or len(arrivals) < policy.quorum:
            return None
        grace = policy.grace()
        if grace is None:
            return None
        return sorted(arrivals.values())[policy.quorum - 1] + grace + GRACE_EPSILON


@dataclass
class Curve:
    """A run's validation loss after each round, at the time the round closed."""

    times: list[float]
    losses: list[float]
    applied_share: float  # of all compute, the share in frames the rounds applied
    decisions: list[tuple[list[int], str]] = field(default_factory=list)
    digest: str = ""  # of the final parameters
    work: list[int] = field(default_factory=list)  # inner phases trained by each round's end

    def loss_after_work(self, work: int) -> float:
        """The loss of the last round by whose end at most ``work`` inner phases were
        trained (inf before the first)."""
        done = [loss for w, loss in zip(self.work, self.losses, strict=True) if w <= work]
        return done[-1] if done else math.inf

    def loss_at(self, t: float) -> float:
        """The loss of the last round closed by ``t`` (inf before the first)."""
        done = [loss for when, loss in zip(self.times, self.losses, strict=True) if when <= t]
        return done[-1] if done else math.inf

    def time_to(self, loss: float) -> float:
        """When the loss first reached ``loss`` (inf if never)."""
        return next((when for when, x in zip(self.times, self.losses, strict=True) if x <= loss), math.inf)


def run_clocked(cfg: RunConfig, compute_s: float, work_s: float = 0.0, close_s: float = 0.0,
                until: float | None = None, max_rounds: int | None = None) -> tuple[Curve, SimClock]:
    """Train ``cfg`` on the simulated clock, for cfg.rounds rounds or until the clock is
    ``over``; the loss curve and the clock with every round."""
    clock = SimClock(cfg, compute_s, work_s, close_s, until, max_rounds)
    result = simulate(cfg, val_every_round=True, clock=clock)
    total = sum(sum(r.compute_s.values()) for r in clock.rounds)
    applied = sum(r.compute_s[i] for r in clock.rounds for i in r.chosen)
    work = [0]
    for r in clock.rounds:  # inner phases: each worker's compute over compute_s
        work.append(work[-1] + round(sum(r.compute_s.values()) / compute_s))
    curve = Curve([r.closed_at for r in clock.rounds], result.val_losses, applied / total if total else 0.0,
                  [(r.chosen, r.reason) for r in clock.rounds], result.digest, work[1:])
    return curve, clock


# ----- the comparison ------------------------------------------------------------------

STRAGGLER_MODELS = {
    # shifted exponential: every round each worker waits 0.1 compute plus a draw of mean 0.5
    "exp": lambda compute_s: f"exp:{0.1 * compute_s:g}:{0.5 * compute_s:g}",
    # Markov slow/fast state per worker, 4x slow, slow about 1 round in 5
    "markov": lambda compute_s: "markov:0.1:0.4:4",
}
LINK_MIX = ("50mbit/25ms", "20mbit/50ms", "10mbit/50ms", "5mbit/100ms")  # dealt round-robin


def scheme_overrides(scheme: str) -> dict[str, Any]:
    """The coding settings of ``scheme``: one straggler tolerated by the coded and quorum
    schemes (s = 1), none by ``none``. ``quorum:G`` is ``quorum`` with its adaptive grace
    window at G times the recent median arrival spread (``coding.grace_spread``);
    ``quorum:G:drop`` (or ``:keep``) sets ``coding.late`` too."""
    name, *variant = scheme.split(":")
    out: dict[str, Any] = {"coding.scheme": name, "coding.stragglers": 0 if name == "none" else 1}
    if variant:
        out["coding.grace_spread"] = float(variant[0])
    if len(variant) > 1:
        out["coding.late"] = variant[1]
    return out


def known_scheme(scheme: str) -> bool:
    """One of SCHEMES, or ``quorum:G`` / ``quorum:G:LATE`` with G a number >= 0 and LATE
    one of coding.late's values."""
    name, *variant = scheme.split(":")
    if not variant:
        return scheme in SCHEMES
    try:
        grace_ok = float(variant[0]) >= 0
    except ValueError:
        return False
    return name == "quorum" and grace_ok and len(variant) <= 2 and all(v in LATE_WORK for v in variant[1:])


SCHEDULE = 2  # every run's learning-rate schedules span SCHEDULE x --rounds rounds


@dataclass(frozen=True)
class Job:
    """One run: ``none`` plays --rounds rounds; every other scheme plays until its clock
    passes ``until``, ``none``'s end on the same seed, so a faster scheme plays more rounds
    on the same schedule."""

    scheme: str
    n: int
    seed: int
    straggler: str  # a key of STRAGGLER_MODELS
    args: dict[str, Any]
    until: float | None = None


def run_job(job: Job) -> dict[str, Any]:
    a = job.args
    profile = STRAGGLER_MODELS[job.straggler](a["compute_s"])
    cfg = load_config(overrides={
        "task.model": a["model"], "task.seq_len": a["seq_len"], "task.batch_size": a["batch_size"],
        "task.val_windows": a["val_windows"], "task.corpus_bytes": a["corpus_bytes"],
        "inner.steps": a["inner_steps"], "inner.warmup_steps": min(4, a["inner_steps"]),
        "workers": job.n, "rounds": SCHEDULE * a["rounds"], "seed": job.seed,
        "coordinator.deadline_s": a["deadline_s"], "stragglers.default": profile,
        "network.per_worker": [LINK_MIX[i % len(LINK_MIX)] for i in range(job.n)],
        **scheme_overrides(job.scheme)})
    start = time.monotonic()
    curve, _ = run_clocked(cfg, a["compute_s"], a["work_s"], a["close_s"], until=job.until,
                           max_rounds=a["rounds"] if job.until is None else None)
    return {"scheme": job.scheme, "n": job.n, "seed": job.seed, "straggler": job.straggler, "times": curve.times,
            "losses": curve.losses, "work": curve.work, "applied_share": curve.applied_share,
            "seconds": time.monotonic() - start}


CODED = ("pgc-fr", "gc-fr")  # each paired against quorum, seed by seed, at equal wall time


def minus_quorum(scheme: str) -> str:
    """The summary key of ``scheme`` - quorum: pgc_fr_minus_quorum."""
    return f"{scheme.replace('-', '_')}_minus_quorum"


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (straggler model, n): each scheme's loss at equal wall time (the earliest end of any
    scheme's run of that seed: ``none``'s, unless a run hit its last round first), at equal
    tokens trained (the fewest inner phases any scheme's run of that seed trained), its time
    to reach ``none``'s final loss, the share of compute applied; pgc-fr - quorum, paired by
    seed."""
    out: dict[str, Any] = {}
    groups = sorted({(r["straggler"], r["n"]) for r in results})
    for straggler, n in groups:
        runs = {(r["scheme"], r["seed"]): r for r in results if r["straggler"] == straggler and r["n"] == n}
        seeds = sorted({seed for _, seed in runs})
        schemes = list(dict.fromkeys(k[0] for k in runs))  # in the order they were run
        rows: dict[str, Any] = {}
        at_time: dict[str, dict[int, float]] = {sc: {} for sc in schemes}
        at_tokens: dict[str, dict[int, float]] = {sc: {} for sc in schemes}
        for seed in seeds:
            curves = {sc: Curve(runs[sc, seed]["times"], runs[sc, seed]["losses"], runs[sc, seed]["applied_share"],
                                work=runs[sc, seed]["work"])
                      for sc in schemes if (sc, seed) in runs}
            horizon = min(c.times[-1] for c in curves.values())
            tokens = min(c.work[-1] for c in curves.values())
            for sc, c in curves.items():
                at_time[sc][seed] = c.loss_at(horizon)
                at_tokens[sc][seed] = c.loss_after_work(tokens)
        for sc in schemes:
            mine = [runs[sc, s] for s in seeds if (sc, s) in runs]
            to_loss = []
            for s in seeds:
                if (sc, s) in runs and ("none", s) in runs:
                    target = runs["none", s]["losses"][-1]
                    c = Curve(runs[sc, s]["times"], runs[sc, s]["losses"], 0.0)
                    to_loss.append(c.time_to(target) / runs["none", s]["times"][-1])
            rows[sc] = {
                "loss_at_equal_time": interval(list(at_time[sc].values())),
                "loss_at_equal_tokens": interval(list(at_tokens[sc].values())),
                # None: some seed never reached none's final loss
                "time_to_loss": statistics.mean(to_loss) if to_loss and all(map(math.isfinite, to_loss)) else None,
                "applied_share": statistics.mean(r["applied_share"] for r in mine),
                "run_seconds": statistics.mean(r["times"][-1] for r in mine),
                "rounds": statistics.mean(len(r["times"]) for r in mine),
            }
        entry: dict[str, Any] = {"schemes": rows}
        for coded in CODED:
            if coded in at_time and "quorum" in at_time:
                diffs = [at_time[coded][s] - at_time["quorum"][s] for s in seeds
                         if s in at_time[coded] and s in at_time["quorum"]]
                entry[minus_quorum(coded)] = {"mean": statistics.mean(diffs), "upper": upper95(diffs),
                                              "seeds": len(diffs)}
        out[f"{straggler} n={n}"] = entry
    return out


def print_table(summary: dict[str, Any]) -> None:
    for group, entry in summary.items():
        print(f"\n{group}")
        print(f"{'scheme':12} {'loss @ time':>22} {'loss @ tokens':>14} {'time to none':>13} "
              f"{'applied':>8} {'run s':>9} {'rounds':>7}")
        for sc, row in entry["schemes"].items():
            t = row["loss_at_equal_time"]
            spread = f"[{t['lower95']:.4f}, {t['upper95']:.4f}]" if t["lower95"] is not None else "(one seed)"
            print(f"{sc:12} {t['mean']:10.4f} {spread:>20} "
                  f"{row['loss_at_equal_tokens']['mean']:14.4f} {_ratio(row['time_to_loss']):>13} "
                  f"{row['applied_share']:8.3f} {row['run_seconds']:9.1f} {row['rounds']:7.1f}")
        for coded in CODED:
            if minus_quorum(coded) in entry:
                d = entry[minus_quorum(coded)]
                print(f"{coded} - quorum at equal time: {d['mean']:+.4f} (one-sided 95 % upper "
                      f"{d['upper']:+.4f}, {d['seeds']} seeds)")


# ----- the validation against real processes --------------------------------------------

VALIDATION_SCHEMES = ("none", "ignore", "quorum", "pgc-fr")
VALIDATION_STRAGGLERS = "exp:0.5:1"  # every worker: 0.5 s plus a draw of mean 1 s, each round
VALIDATION = {"task.model": "gpt-tiny", "task.seq_len": 32, "task.batch_size": 4, "task.val_windows": 16,
              "task.corpus_bytes": 300_000, "inner.steps": 8, "inner.warmup_steps": 2,
              "coordinator.checkpoint_every": 0, "coordinator.deadline_s": 120}


def validation_config(scheme: str, n: int, rounds: int) -> dict[str, Any]:
    return {**VALIDATION, "workers": n, "rounds": rounds, "stragglers.default": VALIDATION_STRAGGLERS,
            "network.per_worker": [LINK_MIX[i % len(LINK_MIX)] for i in range(n)],
            **scheme_overrides(scheme)}


def validate_one(scheme: str, n: int, rounds: int, run_dir: str) -> dict[str, Any]:
    """A real ``geoloco local`` run of ``scheme`` at n workers on shaped links, then its
    simulation with the compute, work and close times the real run measured; rounds 1 on
    (round 0 starts as each worker's FetchState ends, not at once)."""
    from geoloco.launch import run_local

    overrides = validation_config(scheme, n, rounds)
    real = run_local(load_config(overrides={**overrides, "run_dir": run_dir}), stall_timeout_s=300)
    if not real.ok:
        raise RuntimeError(f"{scheme} at n = {n}: the real run failed ({real.error}); logs in {real.logs_dir}")
    lines = real.metrics()[1:]

    def mean_of(key: str) -> float:
        values = [m[key] for m in lines if m.get(key) is not None]
        return statistics.mean(values) if values else 0.0

    partitions = statistics.mean(p for m in lines for p in m["partitions_trained"].values())
    compute_s = mean_of("compute_seconds") / max(partitions, 1.0)
    work_s = mean_of("encode_seconds") + mean_of("worker_apply_seconds_max")
    close_s = mean_of("close_seconds")
    _, clock = run_clocked(load_config(overrides=overrides), compute_s, work_s, close_s)
    simulated = clock.rounds[1:]
    same = sum((sorted(m["chosen"]), m["close_reason"]) == (r.chosen, r.reason)
               for m, r in zip(lines, simulated, strict=True))
    real_s = statistics.mean(m["round_seconds"] for m in lines)
    sim_s = statistics.mean(r.closed_at - r.opened_at for r in simulated)
    return {"scheme": scheme, "n": n, "real_round_s": real_s, "simulated_round_s": sim_s,
            "ratio": sim_s / real_s, "decisions_equal": same / len(lines), "compute_s": compute_s,
            "work_s": work_s, "close_s": close_s}


def validate(ns: list[int], rounds: int, work: str) -> int:
    """The validation table (simulated / real mean round time, rounds 1 on) and its JSON line."""
    rows = []
    print(f"{'n':>3} {'scheme':8} {'real s':>8} {'sim s':>8} {'sim/real':>9} {'same close':>11} "
          f"{'compute':>8} {'work':>6} {'close':>6}", flush=True)
    for n in ns:
        for scheme in VALIDATION_SCHEMES:
            row = validate_one(scheme, n, rounds, f"{work}/{scheme}-{n}")
            rows.append(row)
            print(f"{n:3} {scheme:8} {row['real_round_s']:8.3f} {row['simulated_round_s']:8.3f} "
                  f"{row['ratio']:9.3f} {row['decisions_equal']:11.2f} {row['compute_s']:8.3f} "
                  f"{row['work_s']:6.3f} {row['close_s']:6.3f}", flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"worst |sim/real - 1|: {worst:.3f} (target 0.10)")
    task = load_config(overrides=VALIDATION).task
    print(json.dumps({"validation": rows, "worst_round_time_error": worst, "rounds": rounds,
                      "stragglers": VALIDATION_STRAGGLERS, "links": list(LINK_MIX), **provenance(task)}))
    return 0


def _ratio(value: float | None) -> str:
    return "never" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default=None, help="comma-separated worker counts (default 8,32; --validate 4,8)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds --first-seed .. + --seeds - 1 (a tuning sweep takes seeds the comparison does not)")
    p.add_argument("--schemes", default=",".join(SCHEMES),
                   help=f"comma-separated, of: {', '.join(SCHEMES)}, quorum:G[:keep|drop] "
                        "(grace G x the median spread; late work)")
    p.add_argument("--straggler-models", default="exp,markov",
                   help=f"comma-separated, of: {', '.join(STRAGGLER_MODELS)}")
    p.add_argument("--rounds", type=int, default=None, help="default 30; --validate 12")
    p.add_argument("--compute-s", type=float, default=10.0, help="seconds of compute per partition and round")
    p.add_argument("--work-s", type=float, default=0.0, help="seconds of encode and apply per round")
    p.add_argument("--close-s", type=float, default=0.0, help="the coordinator's seconds from decision to publish")
    p.add_argument("--deadline-s", type=float, default=600.0)
    p.add_argument("--model", default="gpt-nano",
                   help="gpt-nano (0.12M) by default: one model at every n, and n = 256 fits on 2 cores")
    p.add_argument("--inner-steps", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="n = 4, 2 seeds, 4 rounds of H = 2: a smoke test")
    p.add_argument("--validate", action="store_true",
                   help="real geoloco local runs of none, ignore, quorum and pgc-fr at --n (default 4,8) "
                        "beside their simulations: the round-time table")
    p.add_argument("--run-dir", default="runs/bench-simclock", help="--validate: where the real runs go")
    args = p.parse_args(argv)
    if args.validate:
        return validate([int(n) for n in (args.n or "4,8").split(",")], args.rounds or 12, args.run_dir)
    args.n, args.rounds = args.n or "8,32", args.rounds or 30
    if args.quick:
        args.n, args.seeds, args.rounds, args.inner_steps, args.straggler_models = "4", 2, 4, 2, "exp"
        args.schemes, args.val_windows, args.corpus_bytes = "none,quorum,pgc-fr", 16, 300_000
    schemes = args.schemes.split(",")
    unknown = [sc for sc in schemes if not known_scheme(sc)] + [m for m in args.straggler_models.split(",")
                                                             if m not in STRAGGLER_MODELS]
    if unknown:
        p.error(f"unknown scheme or straggler model {unknown[0]!r}")
    if "none" not in schemes:
        schemes.insert(0, "none")  # the reference every figure is judged against
    shared = {"compute_s": args.compute_s, "work_s": args.work_s, "close_s": args.close_s, "deadline_s": args.deadline_s,
              "model": args.model, "inner_steps": args.inner_steps, "seq_len": args.seq_len,
              "batch_size": args.batch_size, "val_windows": args.val_windows,
              "corpus_bytes": args.corpus_bytes, "rounds": args.rounds}
    jobs = [Job(sc, int(n), seed, straggler, shared) for straggler in args.straggler_models.split(",")
            for n in args.n.split(",") for seed in range(args.first_seed, args.first_seed + args.seeds)
            for sc in schemes]
    print(f"simclock: {len(jobs)} runs on {args.jobs} processes: none for {args.rounds} rounds, then the "
          f"others for as long on the simulated clock", flush=True)
    start, results = time.monotonic(), []

    def run_all(pool: ProcessPoolExecutor, todo: list[Job]) -> None:
        for result in pool.map(run_job, todo):
            results.append(result)
            print(f"  [{len(results)}/{len(jobs)}] {result['straggler']} n={result['n']} {result['scheme']} "
                  f"seed {result['seed']}: loss {result['losses'][-1]:.4f} after {len(result['times'])} "
                  f"rounds, {result['times'][-1]:.1f} s simulated ({result['seconds']:.0f} s real)", flush=True)

    with ProcessPoolExecutor(args.jobs) as pool:
        run_all(pool, [j for j in jobs if j.scheme == "none"])
        budget = {(r["straggler"], r["n"], r["seed"]): r["times"][-1] for r in results}
        run_all(pool, [replace(j, until=budget[j.straggler, j.n, j.seed]) for j in jobs if j.scheme != "none"])
    summary = summarize(results)
    print_table(summary)
    print(f"\n{time.monotonic() - start:.0f} s in all")
    task = load_config(overrides={"task.model": args.model, "task.corpus_bytes": args.corpus_bytes}).task
    print(json.dumps({"groups": summary, "settings": shared, **provenance(task)}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
