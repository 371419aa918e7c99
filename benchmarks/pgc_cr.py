"""Pipelined cyclic codes: what mixing pseudo-gradients of different ages costs
(docs/gradient-coding.md, "Pipelined CR: ages").

Under ``pgc-cr`` every holder of a partition holds its own version of it, of a different
age when the training orders are the cyclic shift; the decode then combines the versions
with weights that sum to 1 per partition but extrapolate (some negative). Aligned ages
((s + 1) | n) make every holder train a partition in the same rounds, so a decode uses
one version of each partition. The first table gives, per code, the worst-case |a| of
``make_code`` and the range of the per-(partition, age) weights over every straggler set
and phase. The second trains n = 8 workers with s random stragglers per round (their
frames arrive last; the round decodes without them) and compares the final validation
loss at equal rounds: ``none`` (wait for all: one fresh version of every partition),
``pgc-cr`` with cyclic and with aligned ages, and ``pgc-fr`` (one version per partition,
a = 1) where (s + 1) | n. The round protocol runs in one process (``benchmarks.inprocess``).

    python -m benchmarks.pgc_cr            # n = 8, s = 1..3, 3 seeds, ~15-25 min on 2 cores
    python -m benchmarks.pgc_cr --quick    # n = 4, s = 1, tiny runs: a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from benchmarks.inprocess import no_stragglers, random_stragglers, simulate
from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config
from geoloco.coordinator.gradient_coding import GradientCode, age_weight_range, make_code

WEIGHT_CASES = ((4, 1), (8, 1), (8, 2), (8, 3))


@dataclass(frozen=True)
class Variant:
    """One training run's code: scheme, tolerance, CR ages."""

    scheme: str
    s: int
    aligned: bool = False

    @property
    def name(self) -> str:
        if self.scheme == "none":
            return "none"
        ages = (" aligned" if self.aligned else " cyclic") if self.scheme == "pgc-cr" else ""
        return f"{self.scheme}{ages} s={self.s}"

    def code(self, n: int) -> GradientCode:
        return make_code(self.scheme, n, self.s, aligned=self.aligned if self.scheme == "pgc-cr" else None)


def variants(n: int, tolerances: list[int]) -> list[Variant]:
    out = [Variant("none", 0)]
    for s in tolerances:
        out.append(Variant("pgc-cr", s, aligned=False))
        if n % (s + 1) == 0:
            out += [Variant("pgc-cr", s, aligned=True), Variant("pgc-fr", s)]
    return out


def weight_rows(cases) -> list[dict]:
    rows = []
    for n, s in cases:
        for aligned in (False, True):
            if aligned and n % (s + 1):
                continue
            code = make_code("pgc-cr", n, s, aligned=aligned)
            lo, hi = age_weight_range(code)
            rows.append({"n": n, "s": s, "ages": "aligned" if aligned else "cyclic",
                         "worst_a": code.worst_case_coefficient, "age_weight_min": lo, "age_weight_max": hi})
    return rows


def config(args: argparse.Namespace, v: Variant, seed: int) -> RunConfig:
    return load_config(overrides={
        "workers": args.workers, "rounds": args.rounds, "seed": seed, "task.seq_len": args.seq_len,
        "task.batch_size": args.batch_size, "task.val_windows": args.val_windows, "inner.steps": args.inner_steps,
        "coding.scheme": v.scheme, "coding.stragglers": v.s,
    })


def train(job: tuple[Variant, RunConfig]) -> float:
    v, cfg = job
    late = no_stragglers if v.scheme == "none" else random_stragglers(cfg.workers, v.s, cfg.seed)
    return simulate(cfg, late, code=v.code(cfg.workers)).tail_val_loss()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--stragglers", default="1,2,3", help="the tolerances s to train")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--val-windows", type=int, default=128)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    cases = WEIGHT_CASES
    if args.quick:
        args.workers, args.stragglers, args.rounds, args.inner_steps = 4, "1", 3, 2
        args.seq_len, args.batch_size, args.val_windows, args.seeds = 16, 2, 2, 1
        cases = ((4, 1),)
    print("per-(partition, age) decode weights over every straggler set of size s and pipeline phase")
    print(f"{'n':>3}{'s':>3}  {'ages':<8}{'worst |a|':>10}{'weights min':>13}{'max':>9}")
    weights = weight_rows(cases)
    for r in weights:
        print(f"{r['n']:>3}{r['s']:>3}  {r['ages']:<8}{r['worst_a']:>10.3g}{r['age_weight_min']:>13.3g}"
              f"{r['age_weight_max']:>9.3g}")
    todo = variants(args.workers, [int(x) for x in args.stragglers.split(",")])
    jobs = [(v, s) for s in range(args.seeds) for v in todo]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        losses = list(pool.map(train, [(v, config(args, v, s)) for v, s in jobs]))
    loss = {v: [x for (vv, _), x in zip(jobs, losses, strict=True) if vv == v] for v in todo}
    base = statistics.mean(loss[todo[0]])
    print(f"training: gpt-tiny, {args.workers} workers, {args.rounds} rounds of H={args.inner_steps}, "
          f"s random stragglers per round, seeds 0-{args.seeds - 1}")
    print(f"{'code':<22}" + "".join(f"{'seed ' + str(s):>10}" for s in range(args.seeds))
          + f"{'mean':>10}{'sd':>8}{'vs none':>9}")
    for v in todo:
        m = statistics.mean(loss[v])
        sd = statistics.stdev(loss[v]) if len(loss[v]) > 1 else 0.0
        print(f"{v.name:<22}" + "".join(f"{x:>10.4f}" for x in loss[v]) + f"{m:>10.4f}{sd:>8.4f}"
              f"{100 * (m / base - 1):>+8.2f}%")
    print(json.dumps({"weights": [{k: (round(x, 4) if isinstance(x, float) else x) for k, x in r.items()}
                                  for r in weights],
                      "loss": {v.name: [round(x, 4) for x in loss[v]] for v in todo},
                      "loss_mean": {v.name: round(statistics.mean(loss[v]), 4) for v in todo},
                      **provenance(config(args, todo[0], 0).task)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
