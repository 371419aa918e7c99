"""Stragglers and error feedback judged by loss: at n workers with one worker 4x slow in a
random half of the rounds, each gradient-coded scheme's validation loss at equal tokens
against uncoded SparseLoCo that waits for every worker (gradient coding: Tandon et al.
2017, "Gradient Coding"; docs/gradient-coding.md), beside ``benchmarks.ef_drift``'s
error-feedback drift of the same code (the diagnostic; the loss is the target).

The round protocol runs in one process (``benchmarks.inprocess``). Arrivals are a rule,
not a clock: in a slow round the slow worker's frame arrives after every other (4x the
compute of a round cannot beat the others' 1x); in the other rounds the frames arrive in
a random order, so a scheme that closes early drops a random worker, not always the last
id. Both are drawn from (seed, round). Every scheme trains the same batches per
partition and round, so equal rounds are equal tokens in the global update (classic
``gc-*`` computes each held partition, s + 1 per worker and round; ``ignore`` leaves the
dropped worker's partition out of that round). A run's loss is the mean validation loss
of its last 5 rounds; the figure per scheme is the mean over seeds of loss / uncoded loss
of the same seed, with the spread (sample sd) of that ratio. Target: within 1 %.

    python -m benchmarks.straggler_loss           # n = 8, s = 1, 5 seeds, 40 rounds of H = 15
    python -m benchmarks.straggler_loss --quick   # n = 4, tiny runs: a smoke test
    python -m benchmarks.straggler_loss --schemes none,gc-cr --set outer.aggregation=mean --seeds 2
                                                  # a diagnostic: some schemes, other settings
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

from benchmarks import ef_drift
from benchmarks.inprocess import Stragglers, simulate
from benchmarks.parity import pairs, upper95
from benchmarks.provenance import provenance
from geoloco.config import load_config
from geoloco.coordinator.gradient_coding import make_code

TARGET = 0.01  # |coded / uncoded - 1|, mean over seeds
SLOW_SHARE = 0.5  # the fraction of rounds with a slow worker
DRIFT_ROUNDS = 24


@dataclass(frozen=True)
class Scheme:
    """One coded scheme (or ``none``, wait for all) and, for pgc-cr, its ages."""

    name: str
    aligned: bool | None = None

    @property
    def label(self) -> str:
        return self.name + {None: "", True: " aligned", False: " cyclic"}[self.aligned]


SCHEMES = (Scheme("none"), Scheme("ignore"), Scheme("gc-fr"), Scheme("gc-cr"), Scheme("pgc-fr"),
           Scheme("pgc-cr", aligned=False), Scheme("pgc-cr", aligned=True))
QUICK_SCHEMES = (Scheme("none"), Scheme("gc-fr"), Scheme("pgc-cr", aligned=False))


def chosen_schemes(labels: str | None) -> tuple[Scheme, ...]:
    """The schemes ``--schemes`` names, ``none`` (the reference) first; every scheme for None."""
    if labels is None:
        return SCHEMES
    by_label = {sc.label: sc for sc in SCHEMES}
    unknown = [label for label in labels.split(",") if label not in by_label]
    if unknown:
        raise ValueError(f"--schemes: {unknown[0]!r} is not one of {', '.join(by_label)}")
    return tuple(sc for sc in SCHEMES if sc.name == "none" or sc.label in labels.split(","))


def slow_half(n: int, seed: int) -> Stragglers:
    """The arrival rule: from (seed, round), a slow round (probability SLOW_SHARE) puts a
    random worker last; every round's other arrivals come in a random order."""
    def order(round_: int) -> list[int]:
        rng = np.random.default_rng([seed, round_, 7])
        arrivals = [int(i) for i in rng.permutation(n)]
        if rng.random() < SLOW_SHARE:
            slow = arrivals.pop(int(rng.integers(n)))
            arrivals.append(slow)
        return arrivals
    return order


def run_one(job: tuple[Scheme, dict, int, int]) -> float:
    scheme, base, s, seed = job
    cfg = load_config(overrides={**base, "seed": seed, "coding.scheme": scheme.name,
                                 "coding.stragglers": 0 if scheme.name == "none" else s})
    code = make_code(scheme.name, cfg.workers, cfg.coding.stragglers, cfg.coding.seed, aligned=scheme.aligned)
    return simulate(cfg, slow_half(cfg.workers, seed), code=code).tail_val_loss()


def drift(scheme: Scheme, n: int, s: int, rounds: int) -> float:
    """ef_drift's drift (settled, beta 0.95) of the code under random stragglers."""
    case = ef_drift.Case(scheme.name, n, 0 if scheme.name == "none" else s, "random", scheme.aligned)
    return ef_drift.run(case, settle=True, beta=0.95, rounds=rounds)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--stragglers", type=int, default=1, help="s of every coded scheme")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--inner-steps", type=int, default=15)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--val-windows", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--schemes", default=None, metavar="LABELS",
                   help=f"comma-separated, of: {', '.join(sc.label for sc in SCHEMES)} (none is always run)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every scheme's runs, none's included (repeatable)")
    p.add_argument("--quick", action="store_true", help="n = 4, 3 schemes, 3 rounds of H = 2: a smoke test")
    args = p.parse_args(argv)
    try:
        todo, overrides = chosen_schemes(args.schemes), pairs(args.overrides)
    except ValueError as exc:
        p.error(str(exc))
    drift_rounds = DRIFT_ROUNDS
    if args.quick:
        args.workers, args.rounds, args.inner_steps, args.seq_len, args.batch_size = 4, 3, 2, 16, 2
        args.val_windows, args.seeds, drift_rounds = 8, 2, 6
        todo = todo if args.schemes else QUICK_SCHEMES
    start = time.monotonic()
    base = {"workers": args.workers, "rounds": args.rounds, "inner.steps": args.inner_steps,
            "inner.warmup_steps": round(0.15 * args.rounds * args.inner_steps), "task.seq_len": args.seq_len,
            "task.batch_size": args.batch_size, "task.val_windows": args.val_windows, **overrides}
    divisible = args.workers % (args.stragglers + 1) == 0  # FR and aligned CR need (s + 1) | n
    schemes = [sc for sc in todo if divisible or not (sc.name.endswith("-fr") or sc.aligned)]
    jobs = [(sc, base, args.stragglers, seed) for seed in range(args.seeds) for sc in schemes]
    losses: list[float] = [float("nan")] * len(jobs)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        pending = {pool.submit(run_one, job): i for i, job in enumerate(jobs)}
        for done, future in enumerate(as_completed(pending), 1):  # progress: a line per finished run
            i = pending[future]
            losses[i] = future.result()
            sc, seed = jobs[i][0], jobs[i][3]
            print(f"[{done}/{len(jobs)}] {sc.label} seed {seed}: loss {losses[i]:.4f} "
                  f"({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    table = {sc.label: [loss for (j, *_), loss in zip(jobs, losses, strict=True) if j == sc] for sc in schemes}
    uncoded = table["none"]
    print(f"{args.workers} workers, s = {args.stragglers}, {args.rounds} rounds of H={args.inner_steps}, one worker "
          f"4x slow in a random half of the rounds; loss = mean of the last 5 rounds' validation losses")
    print(f"{'scheme':<18}" + "".join(f"{'seed ' + str(s):>9}" for s in range(args.seeds))
          + f"{'x none':>9}{'sd':>8}{'upper95':>9}{'drift':>8}  target")
    rows = []
    for sc in schemes:
        ratios = [a / b for a, b in zip(table[sc.label], uncoded, strict=True)]
        mean = statistics.mean(ratios)
        sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
        d = drift(sc, args.workers, args.stragglers, drift_rounds)
        met = "-" if sc.name == "none" else ("met" if abs(mean - 1) <= TARGET else "NOT met")
        print(f"{sc.label:<18}" + "".join(f"{x:>9.4f}" for x in table[sc.label])
              + f"{mean:>9.4f}{sd:>8.4f}{upper95(ratios):>9.4f}{d:>8.3f}  {met}")
        rows.append({"scheme": sc.label, "loss": [round(x, 4) for x in table[sc.label]],
                     "ratio_mean": round(mean, 4), "ratio_sd": round(sd, 4),
                     "ratio_upper95": round(upper95(ratios), 4) if len(ratios) > 1 else None,
                     "drift": round(d, 4)})
    coded = [r for r in rows if r["scheme"] != "none"]
    worst = max((abs(r["ratio_mean"] - 1) for r in coded), default=0.0)
    print(f"worst |coded / uncoded - 1| = {worst:.4f} (target <= {TARGET}: {'met' if worst <= TARGET else 'NOT met'}); "
          f"drift: ef_drift's definition, {drift_rounds} rounds of synthetic pseudo-gradients")
    cfg = load_config(overrides={**base})
    print(json.dumps({"rows": rows, "worst_loss_gap": round(worst, 4), "workers": args.workers,
                      "stragglers": args.stragglers, "rounds": args.rounds, "inner_steps": args.inner_steps,
                      "seeds": list(range(args.seeds)), "slow_share": SLOW_SHARE, "drift_rounds": drift_rounds,
                      "overrides": overrides,
                      "wall_s": round(time.monotonic() - start, 1), **provenance(cfg.task)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
