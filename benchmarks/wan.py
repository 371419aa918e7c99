"""SparseLoCo against dense DiLoCo on the same task and emulated WAN links (issue 3), side by
side in one run: 4 workers behind 20 Mbit/s, 50 ms links, in a regime where sending the
dense fp32 pseudo-gradient takes at least 10x the inner-loop compute. Prints a table, then
one JSON line (docs/benchmarks.md explains the regime and the figures).

    python -m benchmarks.wan            # gpt-small, H=1, batch 2 x 64 tokens, 5 rounds
    python -m benchmarks.wan --quick    # gpt-tiny, 2 workers, 2 rounds: a smoke test only

The ideal SparseLoCo round is ``sparse_limit_s`` = inner compute + (bytes up + bytes down
per worker) / link rate + one round trip: everything else (compression, decoding,
applying, digests, the coordinator's validation loss) is overhead.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from geoloco.config import RunConfig, load_config
from geoloco.launcher import run_local
from geoloco.link_profile import LinkProfile

METHODS = ("sparseloco", "diloco")
# The worker's log line after its inner loop (worker/client.py): the round's compute time.
TRAINED = re.compile(r"round (\d+): trained partitions .* in ([\d.]+)s")
QUICK = {"model": "gpt-tiny", "workers": 2, "rounds": 2, "warmup_rounds": 1, "batch_size": 2,
         "seq_len": 32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--wan", default="20mbit/50ms")
    p.add_argument("--model", default="gpt-small", help="gpt-small: 10.8M parameters, 43 MB dense fp32")
    p.add_argument("--inner-steps", type=int, default=1, help="H; small, so communication dominates")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="first rounds left out of the means (start-up, first decode)")
    p.add_argument("--val-batches", type=int, default=1,
                   help="the coordinator measures validation loss every round (models under 20M "
                        "parameters); one batch keeps that off the critical path as far as a user can")
    p.add_argument("--run-dir", default="runs/bench-wan")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 workers, 2 rounds: checks the plumbing only")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    return args


def config(args: argparse.Namespace, method: str) -> RunConfig:
    """The same task, links and seed for both methods; only compression.method differs."""
    return load_config(overrides={
        "workers": args.workers, "rounds": args.rounds, "run_dir": f"{args.run_dir}/{method}",
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_batches": args.val_batches, "inner.steps": args.inner_steps,
        "inner.warmup_steps": 0, "compression.method": method, "network.wan": args.wan,
        "coordinator.deadline_s": 3600.0, "coordinator.checkpoint_every": 0,
    })


def measure(cfg: RunConfig, warmup_rounds: int) -> dict[str, Any]:
    """Run one method through the local launcher; the steady-state means of its rounds."""
    if run_local(cfg) != 0:
        raise SystemExit(f"the {cfg.compression.method} run failed; see {cfg.run_dir}/logs")
    run_dir = Path(cfg.run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = lines[warmup_rounds:]
    summary = json.loads((run_dir / "summary.json").read_text())
    slowest = slowest_compute(run_dir, [m["round"] for m in steady])
    return {
        "rounds": len(steady),
        "round_s": statistics.mean(m["round_seconds"] for m in steady),
        "round_s_max": max(m["round_seconds"] for m in steady),
        "compute_s": statistics.mean(slowest) if slowest else statistics.mean(
            m["compute_seconds"] for m in steady),
        "compute_mean_s": statistics.mean(m["compute_seconds"] for m in steady),
        "up_bytes": statistics.mean(m["upload_bytes_per_worker"] for m in steady),
        "down_bytes": statistics.mean(m["download_bytes_per_worker"] for m in steady),
        "dense_fp32_bytes": summary["dense_fp32_bytes"],
        "final_val_loss": summary["final_val_loss"],
    }


def slowest_compute(run_dir: Path, rounds: list[int]) -> list[float]:
    """Per round, the slowest worker's inner-loop seconds (a round waits for all of them;
    the coordinator's metrics keep only the mean). Empty if the worker logs do not say."""
    per_round: dict[int, float] = {}
    for log_path in (run_dir / "logs").glob("worker-*.log"):
        for match in TRAINED.finditer(log_path.read_text(errors="replace")):
            r, seconds = int(match.group(1)), float(match.group(2))
            per_round[r] = max(per_round.get(r, 0.0), seconds)
    return [per_round[r] for r in rounds if r in per_round] if set(rounds) <= set(per_round) else []


def limit_s(m: dict[str, Any], link: LinkProfile) -> float:
    """Inner compute + bytes up and down over the link rate + one round trip."""
    return m["compute_s"] + (m["up_bytes"] + m["down_bytes"]) * 8.0 / link.rate_bps + link.rtt_s


def report(sparse: dict[str, Any], dense: dict[str, Any], link: LinkProfile) -> dict[str, Any]:
    """The JSON line: the six figures of issue 3, then context fields."""
    dense_send_s = sparse["dense_fp32_bytes"] * 8.0 / link.rate_bps
    limit = limit_s(sparse, link)
    return {
        "sparse_round_s": round(sparse["round_s"], 3),
        "dense_round_s": round(dense["round_s"], 3),
        "sparse_compute_s": round(sparse["compute_s"], 3),
        "sparse_limit_s": round(limit, 3),
        "speedup": round(dense["round_s"] / sparse["round_s"], 2),
        "upload_ratio": round(sparse["up_bytes"] / sparse["dense_fp32_bytes"], 5),
        "sparse_over_limit": round(sparse["round_s"] / limit, 3),
        "dense_limit_s": round(limit_s(dense, link), 3),
        "dense_send_over_compute": round(dense_send_s / sparse["compute_s"], 1),
    }


def table(sparse: dict[str, Any], dense: dict[str, Any], link: LinkProfile) -> str:
    for m in (sparse, dense):
        m["limit_s"] = limit_s(m, link)
    rows = [("steady rounds", "rounds", "d"), ("round s (mean)", "round_s", ".2f"),
            ("round s (max)", "round_s_max", ".2f"), ("limit s", "limit_s", ".2f"),
            ("compute s (slowest)", "compute_s", ".2f"), ("compute s (mean)", "compute_mean_s", ".2f"),
            ("upload B/worker", "up_bytes", ",.0f"),
            ("download B/worker", "down_bytes", ",.0f"), ("final val loss", "final_val_loss", ".4f")]
    lines = [f"{'':<20}{'sparseloco':>14}{'diloco':>14}"]
    lines += [f"{name:<20}{format(sparse[k], f):>14}{format(dense[k], f):>14}" for name, k, f in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    link = LinkProfile.parse(args.wan)
    if link.rate_bps is None:
        raise SystemExit("--wan needs a rate, e.g. 20mbit/50ms")
    sparse, dense = (measure(config(args, method), args.warmup_rounds) for method in METHODS)
    result = report(sparse, dense, link)
    print(table(sparse, dense, link))
    print(f"model {args.model}, H={args.inner_steps}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.workers} workers on {link}: dense fp32 send / inner compute = "
          f"{result['dense_send_over_compute']}x; SparseLoCo round / limit = {result['sparse_over_limit']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
