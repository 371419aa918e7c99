"""Overlapped rounds (outer.overlap none | delayed | eager) side by side in one run: real
processes through ``run_local`` (as benchmarks/wan.py), 4 workers, H = 15, in two regimes:
communication at about 50 % of the inner compute, and at about 150 %. Utilization is the
mean over workers of inner-compute seconds over round seconds (metrics.jsonl); the limit of
a round is max(compute, communication) + encode. The loss at equal tokens comes from the
in-process protocol (benchmarks/inprocess.py, simulate_overlap) in the parity benchmark's
regime (8 workers, batch 8 x 32, iid partitions, 1,024 validation windows, warm-up 15 % of
the inner steps, the mean of the last 5 rounds' validation losses) and SparseLoCo's tuned
settings (benchmarks/parity_tuned.json) over several seeds, paired by seed against
``none``. Prints a table, then one JSON line (docs/benchmarks.md).

    python -m benchmarks.overlap            # 4 workers, H=15, 10 rounds; loss: 5 seeds x 40 rounds
    python -m benchmarks.overlap --loss-only --seeds 3                 # the loss part alone
    python -m benchmarks.overlap --loss-only --set outer.lr=0.5        # ... at another outer lr
    python -m benchmarks.overlap --loss-only --set outer.fold_step=7   # ... folding mid-phase
    python -m benchmarks.overlap --quick    # one regime, 2 workers, H=2, 3 rounds, 1 seed: a smoke test
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.inprocess import VAL_TAIL, simulate_overlap
from benchmarks.parity import TUNED_FILE, load_tuned, pairs
from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config
from geoloco.launch import run_local
from geoloco.profiles import LinkProfile

MODES = ("none", "delayed", "eager")
# gpt-tiny, H = 15, batch 2 x 32 on the test machine: about 0.6 s of compute a round and
# 100 kB per worker a round (20 kB up, 4 x 20 kB down): 4 Mbit/s is about 50 % of it, 1 Mbit/s
# about 150 % (the measured ratio is in the JSON line)
REGIMES = {"comm50": "4mbit/50ms", "comm150": "1mbit/50ms"}
QUICK_LOSS = {"loss_rounds": 2, "seeds": 1, "loss_batch_size": 2, "val_windows": 16}
QUICK = {"workers": 2, "rounds": 3, "warmup_rounds": 1, "inner_steps": 2, "seq_len": 16,
         "regimes": {"comm50": "20mbit/10ms"}, "loss_workers": 2, **QUICK_LOSS}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--inner-steps", type=int, default=15, help="H, in the papers' range")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10, help="rounds of each real-process run")
    p.add_argument("--warmup-rounds", type=int, default=2, help="first rounds left out of the means")
    p.add_argument("--loss-workers", type=int, default=8, help="workers of the loss runs (parity's)")
    add_loss_args(p)
    p.add_argument("--run-dir", default="runs/bench-overlap")
    p.add_argument("--quick", action="store_true", help="tiny runs: checks the plumbing only")
    p.add_argument("--loss-only", action="store_true", help="only the in-process loss at equal tokens")
    args = p.parse_args(argv)
    args.regimes = {} if args.loss_only else dict(REGIMES)
    read_loss_args(p, args)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        if args.loss_only:
            args.regimes = {}
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    return args


def config(args: argparse.Namespace, mode: str, wan: str, run_dir: str, rounds: int, seed: int = 0,
           **extra: Any) -> RunConfig:
    """One task for every arm; only the overlap mode, the link and the seed differ."""
    return load_config(overrides={
        "workers": args.workers, "rounds": rounds, "seed": seed, "run_dir": run_dir,
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_windows": 16, "inner.steps": args.inner_steps, "inner.warmup_steps": 0,
        "outer.overlap": mode, "network.wan": wan, "coordinator.deadline_s": 3600.0,
        "coordinator.checkpoint_every": 0, "coordinator.val_every": 0, **extra,
    })


def measure(cfg: RunConfig, warmup: int) -> dict[str, Any]:
    """One run through the local launcher: the steady rounds' means from metrics.jsonl."""
    if not run_local(cfg).ok:
        raise SystemExit(f"the run in {cfg.run_dir} failed; see its logs")
    lines = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines() if x]
    steady = lines[warmup:]
    return {
        "round_s": statistics.mean(m["round_seconds"] for m in steady),
        "utilization": statistics.mean(min(1.0, m["compute_seconds"] / m["round_seconds"]) for m in steady),
        "compute_s": statistics.mean(m["compute_seconds"] for m in steady),
        "encode_s": statistics.mean(m["encode_seconds_max"] for m in steady),
        "up_bytes": statistics.mean(m["upload_bytes_per_worker"] for m in steady),
        "down_bytes": statistics.mean(m["download_bytes_per_worker"] for m in steady),
        "digest_mismatches": json.loads((Path(cfg.run_dir) / "summary.json").read_text())["digest_mismatches"],
    }


def communication_s(m: dict[str, Any], link: LinkProfile) -> float:
    """Bytes up and down over the link's rate plus one round trip."""
    return (m["up_bytes"] + m["down_bytes"]) * 8.0 / link.rate_bps + link.rtt_s


def paired(losses: dict[str, list[float]], mode: str) -> dict[str, float]:
    """``mode``'s final loss relative to ``none``'s, paired by seed: the mean and the 95 %
    upper bound (Student t) of (mode - none) / none."""
    rel = [(a - b) / b for a, b in zip(losses[mode], losses["none"], strict=True)]
    mean = statistics.mean(rel)
    if len(rel) < 2:
        return {"mean": round(mean, 5), "upper95": None}
    upper = mean + T95.get(len(rel) - 1, 1.96) * statistics.stdev(rel) / math.sqrt(len(rel))
    return {"mean": round(mean, 5), "upper95": round(upper, 5)}


def add_loss_args(p: argparse.ArgumentParser) -> None:
    """The in-process loss runs' options (here and in benchmarks/heterogeneous.py): the
    parity benchmark's regime and SparseLoCo's tuned settings by default."""
    p.add_argument("--loss-rounds", type=int, default=40, help="rounds of each in-process loss run")
    p.add_argument("--loss-batch-size", type=int, default=8, help="batch of the loss runs (parity's)")
    p.add_argument("--val-windows", type=int, default=1024, help="validation windows of the loss runs")
    p.add_argument("--warmup", type=float, default=0.15, help="loss runs' warm-up, a share of the inner steps")
    p.add_argument("--seeds", type=int, default=5, help="in-process loss runs per arm")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the loss runs' seeds start here (tuning: keep them apart from the evaluation's 0..)")
    p.add_argument("--jobs", type=int, default=2, help="loss runs at once")
    p.add_argument("--tuned", default=str(TUNED_FILE),
                   help="the parity benchmark's tuned settings, SparseLoCo's taken for the loss runs ('none': defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every loss run (every arm alike, after --tuned), e.g. outer.lr=0.5")


def read_loss_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """args.overrides: SparseLoCo's tuned settings, then --set's."""
    try:
        args.overrides = {**load_tuned(args.tuned).get("sparseloco", {}), **pairs(args.overrides)}
    except ValueError as e:
        p.error(f"--set: {e}")


def loss_overrides(args: argparse.Namespace, workers: int, seed: int) -> dict[str, Any]:
    """A loss run's config: the parity benchmark's regime (benchmarks/parity.py) at
    ``workers``, SparseLoCo at its tuned settings and --set's overrides."""
    return {
        "workers": workers, "rounds": args.loss_rounds, "seed": seed,
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.loss_batch_size,
        "task.val_windows": args.val_windows, "task.partitioning": "iid", "inner.steps": args.inner_steps,
        "inner.warmup_steps": round(args.warmup * args.loss_rounds * args.inner_steps),
        "compression.method": "sparseloco", **args.overrides,
    }


def loss_seeds(args: argparse.Namespace) -> range:
    return range(args.first_seed, args.first_seed + args.seeds)


def loss_regime(args: argparse.Namespace, workers: int) -> dict[str, Any]:
    """What the loss runs were, for the JSON line."""
    return {"workers": workers, "rounds": args.loss_rounds, "seeds": list(loss_seeds(args)),
            "batch": [args.loss_batch_size, args.seq_len],
            "val_windows": args.val_windows, "warmup": args.warmup, "inner_steps": args.inner_steps,
            "overrides": args.overrides}


def loss_of(job: tuple[RunConfig, list[float] | None]) -> float:
    """One loss run (a config, and each worker's density or None): the mean of its last
    VAL_TAIL rounds' validation losses."""
    cfg, densities = job
    return simulate_overlap(cfg, densities=densities, val_tail=VAL_TAIL).tail_val_loss()


def run_losses(jobs: list[tuple[RunConfig, list[float] | None]], n_jobs: int) -> list[float]:
    """loss_of for every job, n_jobs at once, in the jobs' order."""
    with ProcessPoolExecutor(max_workers=n_jobs) as pool:
        return list(pool.map(loss_of, jobs))


def loss_config(args: argparse.Namespace, mode: str, seed: int) -> RunConfig:
    """A loss run of ``mode``; an outer.fold_step of --set is the overlapped arms' alone."""
    overrides = {**loss_overrides(args, args.loss_workers, seed), "outer.overlap": mode}
    if mode == "none":
        overrides.pop("outer.fold_step", None)
    return load_config(overrides=overrides)


def losses_in_process(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each mode's loss at equal tokens, per seed, --jobs runs at once."""
    jobs = [(mode, seed) for seed in loss_seeds(args) for mode in MODES]
    losses = run_losses([(loss_config(args, mode, seed), None) for mode, seed in jobs], args.jobs)
    out: dict[str, list[float]] = {mode: [] for mode in MODES}
    for (mode, seed), loss in zip(jobs, losses, strict=True):
        out[mode].append(loss)
        print(f"loss {mode} seed {seed}: {loss:.4f}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    load = [os.getloadavg()[0]]
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for regime, wan in args.regimes.items():
        link = LinkProfile.parse(wan)
        for mode in MODES:
            cfg = config(args, mode, wan, f"{args.run_dir}/{regime}-{mode}", args.rounds)
            m = measure(cfg, args.warmup_rounds)
            m["communication_s"] = communication_s(m, link)
            m["limit_s"] = max(m["compute_s"], m["communication_s"]) + m["encode_s"]
            runs.setdefault(regime, {})[mode] = m
            load.append(os.getloadavg()[0])
    losses = losses_in_process(args)
    result: dict[str, Any] = {}
    for regime, by_mode in runs.items():
        comm_over_compute = by_mode["none"]["communication_s"] / by_mode["none"]["compute_s"]
        result[regime] = {"comm_over_compute": round(comm_over_compute, 2)}
        for mode, m in by_mode.items():
            result[regime][mode] = {
                "utilization": round(m["utilization"], 3), "round_s": round(m["round_s"], 3),
                "limit_s": round(m["limit_s"], 3), "communication_s": round(m["communication_s"], 3),
                "round_over_limit": round(m["round_s"] / m["limit_s"], 3),
                "round_over_communication": round(m["round_s"] / m["communication_s"], 3),
                "final_loss": {"mean": round(statistics.mean(losses[mode]), 4),
                               "sd": round(statistics.stdev(losses[mode]), 4) if len(losses[mode]) > 1 else 0.0},
                "digest_mismatches": m["digest_mismatches"],
            }
    result["final_loss"] = {mode: [round(x, 4) for x in values] for mode, values in losses.items()}
    result["loss_vs_none"] = {mode: paired(losses, mode) for mode in MODES[1:]}
    result["loss_seeds"], result["loss_rounds"] = args.seeds, args.loss_rounds
    result["loss_regime"] = loss_regime(args, args.loss_workers)
    result["load_average"] = [round(min(load), 2), round(max(load), 2)]
    print(table(runs, losses))
    print(f"model {args.model}, H={args.inner_steps}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.workers} workers, {args.rounds} rounds ({args.warmup_rounds} warm-up) per run; loss: "
          f"{args.seeds} seeds x {args.loss_rounds} rounds in-process, {args.loss_workers} workers, batch "
          f"{args.loss_batch_size}x{args.seq_len}, mean of the last {VAL_TAIL} rounds' validation losses "
          f"(overrides {args.overrides or 'none'}); load average "
          f"{min(load):.1f}-{max(load):.1f}")
    print(json.dumps({**result, **provenance(loss_config(args, "none", 0).task)}))
    return 0


def table(runs: dict[str, dict[str, dict[str, Any]]], losses: dict[str, list[float]]) -> str:
    lines = [f"{'regime':<9}{'mode':<9}{'util':>7}{'round s':>9}{'limit s':>9}{'comm s':>8}"
             f"{'compute s':>10}{'final loss':>12}"]
    for regime, by_mode in runs.items():
        for mode, m in by_mode.items():
            lines.append(f"{regime:<9}{mode:<9}{m['utilization']:>7.3f}{m['round_s']:>9.3f}"
                         f"{m['limit_s']:>9.3f}{m['communication_s']:>8.3f}{m['compute_s']:>10.3f}"
                         f"{statistics.mean(losses[mode]):>12.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
