"""Heterogeneous links: 4 workers on 50, 20, 10 and 5 Mbit/s against a uniform 50 Mbit/s run
of the same task; fixed density and compression.density = "auto" (worker/density.py), each
with and without overlap (outer.overlap eager). Real processes through ``run_local`` give
the round time; the loss at equal tokens comes from the in-process protocol
(benchmarks/inprocess.py, simulate_overlap) over several seeds, where an auto arm trains
with the per-worker densities its real run settled on (the mean of its steady rounds), in
the parity benchmark's regime at 4 workers with SparseLoCo's tuned settings
(benchmarks/overlap.py, add_loss_args).
Prints a table, then one JSON line (docs/benchmarks.md).

    python -m benchmarks.heterogeneous           # 4 workers, H=15, 10 rounds; loss: 5 seeds x 40 rounds
    python -m benchmarks.heterogeneous --quick   # 3 arms, 2 workers (50, 5 Mbit/s), H=2, 3 rounds: a smoke test
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.overlap import (
    QUICK_LOSS,
    add_loss_args,
    loss_overrides,
    loss_regime,
    loss_seeds,
    read_loss_args,
    run_losses,
)
from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config
from geoloco.launch import run_local

LINKS = ["50mbit/25ms", "20mbit/25ms", "10mbit/25ms", "5mbit/25ms"]
UNIFORM = "50mbit/25ms"
# arm -> (links, density, overlap); the auto arms fit each push into one inner phase (overlap)
# or into --target-push-s, within half to twice the fixed density (the default bounds)
ARMS = {
    "uniform": ("uniform", "fixed", "none"),
    "fixed": ("mixed", "fixed", "none"),
    "fixed+overlap": ("mixed", "fixed", "eager"),
    "auto": ("mixed", "auto", "none"),
    "auto+overlap": ("mixed", "auto", "eager"),
}
FIXED_DENSITY = 64 / 4096
QUICK = {"workers": 2, "rounds": 3, "warmup_rounds": 1, "inner_steps": 2, "seq_len": 16,
         "links": ["50mbit/10ms", "5mbit/10ms"], "arms": ["uniform", "fixed", "auto+overlap"], **QUICK_LOSS}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--inner-steps", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup-rounds", type=int, default=2)
    add_loss_args(p)
    p.add_argument("--target-push-s", type=float, default=0.2,
                   help="compression.target_push_s of the auto arm without overlap")
    p.add_argument("--run-dir", default="runs/bench-heterogeneous")
    p.add_argument("--quick", action="store_true", help="tiny runs: checks the plumbing only")
    args = p.parse_args(argv)
    read_loss_args(p, args)
    args.links, args.workers, args.arms = list(LINKS), len(LINKS), list(ARMS)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def config(args: argparse.Namespace, arm: str, run_dir: str, rounds: int) -> RunConfig:
    """An arm's real-process run."""
    links, density, overlap = ARMS[arm]
    auto = density == "auto"
    return load_config(overrides={
        "workers": args.workers, "rounds": rounds, "run_dir": run_dir,
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_windows": 16, "inner.steps": args.inner_steps, "inner.warmup_steps": 0,
        "outer.overlap": overlap,
        "network.wan": UNIFORM if links == "uniform" else args.links[0],
        "network.per_worker": [] if links == "uniform" else args.links,
        "compression.density": "auto" if auto else FIXED_DENSITY,
        "compression.density_min": FIXED_DENSITY / 2, "compression.density_max": FIXED_DENSITY * 2,
        "compression.target_push_s": args.target_push_s if auto and overlap == "none" else None,
        "coordinator.deadline_s": 3600.0, "coordinator.checkpoint_every": 0, "coordinator.val_every": 0,
    })


def loss_config(args: argparse.Namespace, arm: str, seed: int) -> RunConfig:
    """An arm's in-process loss run: its overlap mode, at the fixed density (an auto arm's
    per-worker densities go to simulate_overlap)."""
    return load_config(overrides={**loss_overrides(args, args.workers, seed), "outer.overlap": ARMS[arm][2],
                                  "compression.density": FIXED_DENSITY})


def measure(cfg: RunConfig, warmup: int) -> dict[str, Any]:
    if not run_local(cfg, overwrite=True).ok:  # this benchmark's own run dirs, from a run before
        raise SystemExit(f"the run in {cfg.run_dir} failed; see its logs")
    lines = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines() if x]
    steady = lines[warmup:]
    densities = [statistics.mean(m["density_by_worker"][str(w)] for m in steady) for w in range(cfg.workers)]
    return {"round_s": statistics.mean(m["round_seconds"] for m in steady),
            "compute_s": statistics.mean(m["compute_seconds"] for m in steady),
            "densities": densities}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    load = [os.getloadavg()[0]]
    runs: dict[str, dict[str, Any]] = {}
    for arm in args.arms:
        runs[arm] = measure(config(args, arm, f"{args.run_dir}/{arm}", args.rounds), args.warmup_rounds)
        load.append(os.getloadavg()[0])
    # equal tokens: the same rounds for every arm; in-process the links play no part, so arms
    # alike in overlap and densities (uniform and fixed) share their runs
    def loss_key(arm: str, seed: int) -> tuple:
        auto = ARMS[arm][1] == "auto"
        return ARMS[arm][2], tuple(runs[arm]["densities"]) if auto else None, seed

    jobs = {loss_key(arm, seed): (arm, seed) for seed in loss_seeds(args) for arm in runs}
    losses = dict(zip(jobs, run_losses([(loss_config(args, arm, seed), None if key[1] is None else list(key[1]))
                                        for key, (arm, seed) in jobs.items()], args.jobs), strict=True))
    for arm in runs:
        runs[arm]["losses"] = [losses[loss_key(arm, seed)] for seed in loss_seeds(args)]
    uniform, fixed = runs["uniform"], runs["fixed"]
    result: dict[str, Any] = {}
    for arm, m in runs.items():
        rel = [(a - b) / b for a, b in zip(m["losses"], fixed["losses"], strict=True)]
        result[arm] = {"round_s": round(m["round_s"], 3),
                       "round_over_uniform": round(m["round_s"] / uniform["round_s"], 3),
                       "final_loss": {"mean": round(statistics.mean(m["losses"]), 4),
                                      "sd": round(statistics.stdev(m["losses"]), 4) if len(m["losses"]) > 1 else 0.0},
                       "loss_vs_fixed": round(statistics.mean(rel), 5),
                       "densities": [round(d, 5) for d in m["densities"]]}
    result["links"], result["loss_seeds"] = args.links, args.seeds
    result["loss_regime"] = loss_regime(args, args.workers)
    result["load_average"] = [round(min(load), 2), round(max(load), 2)]
    print(f"{'arm':<15}{'round s':>9}{'/ uniform':>11}{'final loss':>12}{'vs fixed':>10}  densities")
    for arm, r in result.items():
        if arm in ARMS:
            print(f"{arm:<15}{r['round_s']:>9.3f}{r['round_over_uniform']:>11.3f}"
                  f"{r['final_loss']['mean']:>12.4f}{r['loss_vs_fixed']:>10.4f}  {r['densities']}")
    print(f"links {args.links} (uniform {UNIFORM}), H={args.inner_steps}, {args.rounds} rounds per run; "
          f"loss: {args.seeds} seeds x {args.loss_rounds} rounds in-process, batch {args.loss_batch_size}x"
          f"{args.seq_len}, overrides {args.overrides or 'none'}; load average "
          f"{min(load):.1f}-{max(load):.1f}")
    print(json.dumps({**result, **provenance(loss_config(args, "fixed", 0).task)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
