"""An island of 2 ranks against 2 separate workers of 1 rank each, side by side in one run
(the island under ``worker.parallel = "ddp"`` and under ``"fsdp"``):
real processes through ``run_local`` on the same shaped links, with the same tokens per
round (the island's batch is 2 x each separate worker's, so both train 2 x batch x H
sequences a round). Per arm: the WAN bytes of a round (every worker's upload and download),
the round time and the final validation loss, over several seeds, paired by seed; for the
fsdp island, the share of the model's elements, of the AdamW moments, of θ and of the error
feedback each rank held.
Prints a table, then one JSON line (docs/benchmarks.md).

    python -m benchmarks.island              # gpt-tiny, H = 15, 12 rounds, 3 seeds, 4 Mbit/s links
    python -m benchmarks.island --quick      # 2 rounds of H = 2, 1 seed: a smoke test only

On this 2-core machine the island's 2 ranks share the cores with the coordinator just as the
2 separate workers do; the round time compares the two arms under that same load, not an
island on its own fabric.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.overlap import T95
from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config
from geoloco.launch import run_local
from geoloco.run_dir import WORKERS_DIR

ARMS = ("island", "fsdp", "separate")  # island: ddp; fsdp: the same island, sharded
QUICK = {"rounds": 2, "warmup_rounds": 1, "inner_steps": 2, "seq_len": 16, "seeds": 1,
         "wan": "20mbit/10ms"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--wan", default="4mbit/50ms", help="every worker's link (the island's too)")
    p.add_argument("--inner-steps", type=int, default=15, help="H")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and inner step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup-rounds", type=int, default=2, help="first rounds left out of the time means")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--run-dir", default="runs/bench-island")
    p.add_argument("--quick", action="store_true", help="tiny runs: checks the plumbing only")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    return args


def config(args: argparse.Namespace, arm: str, seed: int) -> RunConfig:
    """The island (ddp) and fsdp: 1 worker of 2 ranks with a batch of 2 x --batch-size;
    separate: 2 workers of --batch-size each. The same task, links, seed and tokens per
    round otherwise."""
    island = arm != "separate"
    return load_config(overrides={
        "workers": 1 if island else 2, "rounds": args.rounds, "seed": seed,
        "run_dir": f"{args.run_dir}/{arm}-seed{seed}",
        "task.model": args.model, "task.seq_len": args.seq_len,
        "task.batch_size": 2 * args.batch_size if island else args.batch_size,
        "task.val_windows": 64, "inner.steps": args.inner_steps, "inner.warmup_steps": 0,
        "worker.nproc_per_node": 2 if island else 1, "worker.device": "cpu",
        "worker.parallel": "fsdp" if arm == "fsdp" else "ddp",
        "network.wan": args.wan, "coordinator.deadline_s": 3600.0,
        "coordinator.checkpoint_every": 0, "coordinator.val_every": 0,
    })


def measure(cfg: RunConfig, warmup: int) -> dict[str, Any]:
    """One run through the local launcher: WAN bytes and time of the steady rounds, final loss."""
    if not run_local(cfg, overwrite=True).ok:  # this benchmark's own run dirs, from a run before
        raise SystemExit(f"the run in {cfg.run_dir} failed; see its logs")
    run_dir = Path(cfg.run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steady = lines[warmup:]
    return {
        "wan_bytes_per_round": statistics.mean(
            cfg.workers * (m["upload_bytes_per_worker"] + m["download_bytes_per_worker"]) for m in steady),
        "round_s": statistics.mean(m["round_seconds"] for m in steady),
        "final_loss": summary["final_val_loss"],
        "digest_mismatches": summary["digest_mismatches"],
        "held": held_shares(run_dir),
    }


def held_shares(run_dir: Path) -> dict[str, list[float]] | None:
    """An fsdp island's report: each rank's share of the model's elements and of the AdamW
    moments' (None for a worker that holds the whole model)."""
    for path in sorted((run_dir / WORKERS_DIR).glob("worker-*.json")):
        held = json.loads(path.read_text()).get("island", {}).get("held")
        if held:
            return {key: [round(n / sum(counts), 4) for n in counts] for key, counts in held.items()}
    return None


def interval(values: list[float]) -> dict[str, float | None]:
    """Mean and two-sided 95 % interval (Student t) of paired differences."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return {"mean": round(mean, 5), "lower95": None, "upper95": None}
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": round(mean, 5), "lower95": round(mean - half, 5), "upper95": round(mean + half, 5)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for seed in range(args.seeds):
        for arm in ARMS:  # interleaved: a change of load hits both arms
            runs[arm].append(measure(config(args, arm, seed), args.warmup_rounds))
            load.append(os.getloadavg()[0])
            print(f"seed {seed} {arm}: {runs[arm][-1]}", file=sys.stderr, flush=True)
    result: dict[str, Any] = {}
    for arm in ARMS:
        result[arm] = {key: round(statistics.mean(r[key] for r in runs[arm]), 5)
                       for key in ("wan_bytes_per_round", "round_s", "final_loss")}
        result[arm]["final_loss_by_seed"] = [round(r["final_loss"], 5) for r in runs[arm]]
        result[arm]["digest_mismatches"] = sum(r["digest_mismatches"] for r in runs[arm])
        result[arm]["held"] = runs[arm][-1]["held"]
    result["wan_bytes_ratio"] = round(result["island"]["wan_bytes_per_round"]
                                      / result["separate"]["wan_bytes_per_round"], 4)
    result["round_s_ratio"] = round(result["island"]["round_s"] / result["separate"]["round_s"], 4)
    result["fsdp_round_s_ratio"] = round(result["fsdp"]["round_s"] / result["island"]["round_s"], 4)
    result["fsdp_loss_vs_ddp"] = interval([(a["final_loss"] - b["final_loss"]) / b["final_loss"]
                                           for a, b in zip(runs["fsdp"], runs["island"], strict=True)])
    result["loss_vs_separate"] = interval([(a["final_loss"] - b["final_loss"]) / b["final_loss"]
                                           for a, b in zip(runs["island"], runs["separate"], strict=True)])
    result["seeds"], result["rounds"] = args.seeds, args.rounds
    result["load_average"] = [round(min(load), 2), round(max(load), 2)]
    print(table(result))
    print(f"model {args.model}, H={args.inner_steps}, {args.rounds} rounds ({args.warmup_rounds} left out of "
          f"the times), links {args.wan}, tokens per round 2 x {args.batch_size} x {args.seq_len} x H in "
          f"both arms, {args.seeds} seeds; load average {min(load):.1f}-{max(load):.1f}")
    print(json.dumps({**result, **provenance(config(args, "island", 0).task)}))
    return 0


def table(result: dict[str, Any]) -> str:
    lines = [f"{'arm':<10}{'WAN bytes/round':>17}{'round s':>9}{'final loss':>12}"]
    for arm in ARMS:
        r = result[arm]
        lines.append(f"{arm:<10}{r['wan_bytes_per_round']:>17,.0f}{r['round_s']:>9.3f}{r['final_loss']:>12.4f}")
    loss = result["loss_vs_separate"]
    spread = "-" if loss["lower95"] is None else f"{loss['lower95']:+.2%} to {loss['upper95']:+.2%}"
    lines.append(f"island / separate: WAN bytes {result['wan_bytes_ratio']:.3f}, round time "
                 f"{result['round_s_ratio']:.3f}, loss {loss['mean']:+.2%} (95 % interval {spread})")
    fsdp, held = result["fsdp_loss_vs_ddp"], result["fsdp"]["held"] or {}
    spread = "-" if fsdp["lower95"] is None else f"{fsdp['lower95']:+.2%} to {fsdp['upper95']:+.2%}"
    lines.append(f"fsdp / ddp island: round time {result['fsdp_round_s_ratio']:.3f}, loss {fsdp['mean']:+.2%} "
                 f"(95 % interval {spread}); each rank held {held.get('params')} of the model, "
                 f"{held.get('adamw')} of the AdamW moments, {held.get('theta')} of θ, {held.get('error_feedback')} "
                 "of the error feedback")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
