"""SparseLoCo against dense DiLoCo on the same task and emulated WAN links, side by
side in one run: 4 workers behind 1 Mbit/s, 50 ms links, H = 15 inner steps (the papers'
range), in a regime where sending the dense bf16 pseudo-gradient takes at least 10x the
inner-loop compute. The dense baseline sends bf16, as DiLoCo implementations do (the
coordinator broadcasts its update in bf16 too); fp32 is an extra column. Prints a table,
then one JSON line (docs/benchmarks.md explains the regime and the figures).

    python -m benchmarks.wan            # gpt-tiny, H=15, batch 2 x 32 tokens, 4 rounds
    python -m benchmarks.wan --quick    # 2 workers, 2 rounds of H=2: a smoke test only
    python -m benchmarks.wan --model hf:examples/llama_20m --tokenizer train:8192   # a 20.8M Llama

The ideal SparseLoCo round is ``sparse_limit_s`` = inner compute + (bytes up + bytes down
per worker) / link rate + one round trip + the coordinator's uplink: it sends every
worker all the round's frames, n x the download per worker, at ``--coordinator-uplink``
(a stated rate: the local emulator shapes the workers' links only, so the measured round
does not pay this term). Everything else (compression, applying the round result, the
coordinator's close, waiting for the slowest worker) is overhead; the breakdown table
shows how much of each a round spent, from the coordinator's metrics.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config
from geoloco.launch import run_local
from geoloco.profiles import LinkProfile

RUNS = {"sparseloco": ("sparseloco", "fp32"), "diloco": ("diloco", "bf16"), "diloco-fp32": ("diloco", "fp32")}
QUICK = {"model": "gpt-tiny", "workers": 2, "rounds": 2, "warmup_rounds": 1, "batch_size": 2,
         "seq_len": 16, "inner_steps": 2, "wan": "20mbit/10ms"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--wan", default="1mbit/50ms", help="every worker's link")
    p.add_argument("--coordinator-uplink", default="1gbit",
                   help="the coordinator's own uplink rate, counted in sparse_limit_s (not emulated)")
    p.add_argument("--model", default="gpt-tiny",
                   help="task.model: gpt-tiny (1.03M parameters, 2.1 MB dense bf16), module:function, "
                        "or hf:PATH, e.g. hf:examples/llama_20m (20.8M)")
    p.add_argument("--tokenizer", default="auto", help="task.tokenizer, e.g. train:8192 for an hf: model")
    p.add_argument("--inner-steps", type=int, default=15, help="H, in the papers' range (15-30)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="first rounds left out of the means (start-up, first decode)")
    p.add_argument("--val-every", type=int, default=None,
                   help="coordinator.val_every (default: every round for this model). The loss is "
                        "measured after the broadcast, but here the coordinator shares the cores "
                        "with the workers; 0 measures it only after the last round")
    p.add_argument("--val-windows", type=int, default=2, help="task.val_windows")
    p.add_argument("--run-dir", default="runs/bench-wan")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 workers, 2 rounds: checks the plumbing only")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    return args


def config(args: argparse.Namespace, run: str) -> RunConfig:
    """The same task, links and seed for every run; only the compression method and the
    dense dtype differ."""
    method, dtype = RUNS[run]
    return load_config(overrides={
        "workers": args.workers, "rounds": args.rounds, "run_dir": f"{args.run_dir}/{run}",
        "task.model": args.model, "task.tokenizer": args.tokenizer,
        "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_windows": args.val_windows, "inner.steps": args.inner_steps,
        "inner.warmup_steps": 0, "compression.method": method, "compression.dense_dtype": dtype,
        "network.wan": args.wan,
        "coordinator.deadline_s": 3600.0, "coordinator.checkpoint_every": 0,
        "coordinator.val_every": args.val_every,  # None: the config's default
    })


def measure(cfg: RunConfig, warmup_rounds: int) -> dict[str, Any]:
    """Run one method through the local launcher; the steady-state means of its rounds."""
    if not run_local(cfg).ok:
        raise SystemExit(f"the {cfg.compression.method} run failed; see {cfg.run_dir}/logs")
    run_dir = Path(cfg.run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = lines[warmup_rounds:]
    summary = json.loads((run_dir / "summary.json").read_text())

    def mean(key: str) -> float:
        return statistics.mean(m[key] for m in steady)

    return {
        "rounds": len(steady),
        "round_s": mean("round_seconds"),
        "round_s_max": max(m["round_seconds"] for m in steady),
        # a round waits for all workers, and on shared cores they do not finish together
        "compute_s": mean("compute_seconds_max"),
        "compute_mean_s": mean("compute_seconds"),
        "encode_s": mean("encode_seconds_max"),
        "worker_apply_s": mean("worker_apply_seconds_max"),
        "close_s": mean("close_seconds"),
        "coordinator_apply_s": mean("coordinator_apply_seconds"),
        "up_bytes": mean("upload_bytes_per_worker"),
        "down_bytes": mean("download_bytes_per_worker"),
        "dense_fp32_bytes": summary["dense_fp32_bytes"],
        "final_val_loss": summary["final_val_loss"],
    }


@dataclass(frozen=True)
class Links:
    """The workers' link and the coordinator's stated uplink rate."""

    worker: LinkProfile
    coordinator_bps: float
    workers: int

    def coordinator_s(self, m: dict[str, Any]) -> float:
        """The coordinator's uplink carries every worker's download: n x down bytes."""
        return self.workers * m["down_bytes"] * 8.0 / self.coordinator_bps


def transfer_s(m: dict[str, Any], links: Links) -> float:
    """Bytes up and down over the worker's link rate + one round trip + the coordinator's
    uplink time."""
    return (m["up_bytes"] + m["down_bytes"]) * 8.0 / links.worker.rate_bps + links.worker.rtt_s + \
        links.coordinator_s(m)


def limit_s(m: dict[str, Any], links: Links) -> float:
    """Inner compute + the transfer."""
    return m["compute_s"] + transfer_s(m, links)


def report(runs: dict[str, dict[str, Any]], links: Links) -> dict[str, Any]:
    """The JSON line: the headline figures, then context fields."""
    sparse, dense, fp32 = runs["sparseloco"], runs["diloco"], runs["diloco-fp32"]
    dense_send_s = dense["up_bytes"] * 8.0 / links.worker.rate_bps
    limit = limit_s(sparse, links)
    return {
        "sparse_round_s": round(sparse["round_s"], 3),
        "dense_round_s": round(dense["round_s"], 3),
        "dense_fp32_round_s": round(fp32["round_s"], 3),
        "sparse_compute_s": round(sparse["compute_s"], 3),
        "sparse_limit_s": round(limit, 3),
        "coordinator_uplink_s": round(links.coordinator_s(sparse), 4),
        "speedup": round(dense["round_s"] / sparse["round_s"], 2),
        "speedup_fp32": round(fp32["round_s"] / sparse["round_s"], 2),
        "upload_ratio": round(sparse["up_bytes"] / dense["up_bytes"], 5),
        "upload_ratio_fp32": round(sparse["up_bytes"] / fp32["up_bytes"], 5),
        "sparse_over_limit": round(sparse["round_s"] / limit, 3),
        "dense_limit_s": round(limit_s(dense, links), 3),
        "dense_send_over_compute": round(dense_send_s / sparse["compute_s"], 1),
        "sparse_encode_s": round(sparse["encode_s"], 3),
        "sparse_worker_apply_s": round(sparse["worker_apply_s"], 3),
        "sparse_close_s": round(sparse["close_s"], 3),
    }


def table(runs: dict[str, dict[str, Any]], links: Links) -> str:
    for m in runs.values():
        m["limit_s"] = limit_s(m, links)
    rows = [("steady rounds", "rounds", "d"), ("round s (mean)", "round_s", ".2f"),
            ("round s (max)", "round_s_max", ".2f"), ("limit s", "limit_s", ".2f"),
            ("compute s (slowest)", "compute_s", ".2f"), ("compute s (mean)", "compute_mean_s", ".2f"),
            ("upload B/worker", "up_bytes", ",.0f"),
            ("download B/worker", "down_bytes", ",.0f"), ("final val loss", "final_val_loss", ".4f")]
    return _columns(rows, runs)


def breakdown(runs: dict[str, dict[str, Any]], links: Links) -> str:
    """Where a steady round's seconds go (means over the steady rounds; the worker figures
    are each round's slowest worker, so the parts are an upper bound of the critical path
    and "other" may come out small or negative)."""
    for m in runs.values():
        m["transfer_s"] = transfer_s(m, links)
        parts = ("compute_s", "encode_s", "transfer_s", "worker_apply_s", "close_s")
        m["other_s"] = m["round_s"] - sum(m[k] for k in parts)
    rows = [("compute (slowest)", "compute_s", ".3f"),
            ("encode (slowest)", "encode_s", ".3f"),
            ("transfer (ideal)", "transfer_s", ".3f"),
            ("worker apply (slowest)", "worker_apply_s", ".3f"),
            ("coordinator close", "close_s", ".3f"),
            ("other: wait, gRPC, CPU", "other_s", ".3f"),
            ("= round s (mean)", "round_s", ".3f"),
            ("coord. apply+digest *", "coordinator_apply_s", ".3f")]
    return (_columns(rows, runs) + "\n* after the broadcast, beside the transfer: "
            "not on the critical path")


def _columns(rows: list[tuple[str, str, str]], runs: dict[str, dict[str, Any]]) -> str:
    heads = {"sparseloco": "sparseloco", "diloco": "diloco bf16", "diloco-fp32": "diloco fp32"}
    lines = [f"{'':<24}" + "".join(f"{heads[r]:>13}" for r in runs)]
    lines += [f"{name:<24}" + "".join(f"{format(m[k], f):>13}" for m in runs.values()) for name, k, f in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    link = LinkProfile.parse(args.wan)
    coordinator = LinkProfile.parse(args.coordinator_uplink)
    if link.rate_bps is None or coordinator.rate_bps is None:
        raise SystemExit("--wan and --coordinator-uplink need a rate, e.g. 1mbit/50ms and 1gbit")
    links = Links(link, coordinator.rate_bps, args.workers)
    load = [os.getloadavg()[0]]
    runs = {}
    for run in RUNS:
        runs[run] = measure(config(args, run), args.warmup_rounds)
        load.append(os.getloadavg()[0])
    result = report(runs, links)
    result["load_average"] = [round(min(load), 2), round(max(load), 2)]
    print(table(runs, links))
    print()
    print(breakdown(runs, links))
    print(f"model {args.model}, H={args.inner_steps}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.workers} workers on {link}, coordinator uplink {args.coordinator_uplink} "
          f"({result['coordinator_uplink_s']}s of the limit): dense bf16 send / inner compute = "
          f"{result['dense_send_over_compute']}x; SparseLoCo round / limit = {result['sparse_over_limit']}; "
          f"load average {min(load):.1f}-{max(load):.1f}")
    print(json.dumps({**result, **provenance(config(args, "sparseloco").task)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
