"""The two 2-bit quantizers side by side: GeoLoCo's ``two-level`` (sign x {lo, hi} per
chunk, the medians of the halves) and the SparseLoCo reference's ``four-bin`` (4 bins
over mean-centred values, scale 6 sigma / 4, bin means, one table per tensor; Sarfi et al.
2025, arXiv 2508.15706, and templar's compress.py). For each: frame bytes and relative
error on synthetic pseudo-gradients (as ``benchmarks.codec`` defines them), then the
final validation loss of SparseLoCo training at equal tokens over several seeds (the
round protocol in one process, ``benchmarks.inprocess``) with the bytes it sent.

    python -m benchmarks.quantizer           # 4 workers, 20 rounds of H=15, seeds 0-2, ~10-20 min
    python -m benchmarks.quantizer --quick   # small tensors, 2 workers, 2 rounds, 2 seeds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks.codec import pseudo_gradients, quant_error
from benchmarks.inprocess import simulate
from benchmarks.provenance import provenance
from geoloco.compression import Layout, TensorSpec
from geoloco.config import RunConfig, load_config
from geoloco.replica import QUANTIZER_TABLES

QUANTIZERS = tuple(QUANTIZER_TABLES)  # two-level, four-bin


def codec_rows(side: int) -> list[dict]:
    """Bytes, bits per parameter and relative error of each quantizer on one matrix, from
    a zero error state (``benchmarks.codec.quant_error``)."""
    layout = Layout([TensorSpec("w", (side, 4 * side), torch.float32)])
    g = torch.Generator().manual_seed(2)
    data = {"row-scaled": pseudo_gradients(layout, seed=1), "iid": [torch.randn(side, 4 * side, generator=g)]}
    rows = []
    for kind, deltas in data.items():
        for q in QUANTIZERS:
            err, ref, nbytes = quant_error(layout, deltas, table=QUANTIZER_TABLES[q])
            rows.append({"data": kind, "quantizer": q, "bytes": nbytes, "bits_per_param": 8 * nbytes / layout.numel,
                         "rel_error": math.sqrt(err / ref)})
    return rows


def config(args: argparse.Namespace, quantizer: str, seed: int) -> RunConfig:
    return load_config(overrides={
        "workers": args.workers, "rounds": args.rounds, "seed": seed, "task.seq_len": args.seq_len,
        "task.batch_size": args.batch_size, "task.val_windows": args.val_windows, "inner.steps": args.inner_steps,
        "compression.quantizer": quantizer,
    })


def train(cfg: RunConfig) -> tuple[float, float]:
    result = simulate(cfg)
    return result.tail_val_loss(), statistics.mean(result.upload_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inner-steps", type=int, default=15)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--side", type=int, default=1024, help="codec rows: a side x 4*side matrix")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.rounds, args.inner_steps, args.seq_len = 2, 2, 2, 16
        args.batch_size, args.val_windows, args.seeds, args.side = 2, 2, 2, 128
    codec = codec_rows(args.side)
    print(f"codec, {args.side}x{4 * args.side} fp32, k = 64 of 4096, from a zero error state")
    print(f"{'data':<12}{'quantizer':<11}{'bytes':>10}{'bits/param':>12}{'rel. error':>12}")
    for r in codec:
        print(f"{r['data']:<12}{r['quantizer']:<11}{r['bytes']:>10,}{r['bits_per_param']:>12.4f}{r['rel_error']:>12.3f}")
    jobs = [(q, s) for s in range(args.seeds) for q in QUANTIZERS]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(train, [config(args, q, s) for q, s in jobs]))
    loss = {q: [r[0] for (qq, _), r in zip(jobs, runs, strict=True) if qq == q] for q in QUANTIZERS}
    up = {q: statistics.mean(r[1] for (qq, _), r in zip(jobs, runs, strict=True) if qq == q) for q in QUANTIZERS}
    print(f"training: gpt-tiny, {args.workers} workers, {args.rounds} rounds of H={args.inner_steps}, batch "
          f"{args.batch_size}x{args.seq_len}, seeds 0-{args.seeds - 1}")
    print(f"{'quantizer':<11}" + "".join(f"{'seed ' + str(s):>10}" for s in range(args.seeds))
          + f"{'mean':>10}{'sd':>8}{'up B/round':>12}")
    for q in QUANTIZERS:
        sd = statistics.stdev(loss[q]) if len(loss[q]) > 1 else 0.0
        print(f"{q:<11}" + "".join(f"{x:>10.4f}" for x in loss[q]) + f"{statistics.mean(loss[q]):>10.4f}"
              f"{sd:>8.4f}{up[q]:>12,.0f}")
    diffs = [b - a for a, b in zip(loss["two-level"], loss["four-bin"], strict=True)]
    print(f"four-bin - two-level per seed: {' '.join(f'{d:+.4f}' for d in diffs)}")
    print(json.dumps({"codec": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in codec],
                      "loss": {q: [round(x, 4) for x in v] for q, v in loss.items()},
                      "loss_mean": {q: round(statistics.mean(v), 4) for q, v in loss.items()},
                      "upload_bytes_per_round": {q: round(v) for q, v in up.items()},
                      "four_bin_minus_two_level": [round(d, 4) for d in diffs],
                      **provenance(config(args, "two-level", 0).task)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
