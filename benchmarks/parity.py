"""Loss parity at equal tokens over several seeds: SparseLoCo and dense DiLoCo (the round
protocol in one process, ``benchmarks.inprocess``: the same parameters, bit for bit, as
``geoloco local``), and plain single-process AdamW seeing the same batches (every
partition's batch of a step at once, so the same tokens in rounds x H steps). Prints a
table per seed, the mean and spread, then one JSON line with ratio = mean SparseLoCo /
mean DiLoCo validation loss (target <= 0.92; the SparseLoCo paper, Sarfi et al. 2025,
arXiv 2508.15706, reports SparseLoCo below DiLoCo) and the gap to AdamW.
docs/benchmarks.md records the regime and what was tried.

    python -m benchmarks.parity            # gpt-tiny, 8 workers, 20 rounds of H=15, seeds 0-2
    python -m benchmarks.parity --quick    # 2 workers, 2 rounds of H=2, 2 seeds: a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks.inprocess import simulate
from geoloco.config import RunConfig, load_config
from geoloco.tasks import build_task
from geoloco.worker.trainer import lr_at

TARGET = 0.92
METHODS = ("sparseloco", "diloco", "adamw")
QUICK = {"workers": 2, "rounds": 2, "inner_steps": 2, "seq_len": 16, "batch_size": 2, "val_windows": 2,
         "seeds": 2}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inner-steps", type=int, default=15, help="H")
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per worker and inner step")
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. SEEDS-1")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a SparseLoCo config override, e.g. compression.quantizer=four-bin (repeatable)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one core each)")
    p.add_argument("--quick", action="store_true", help="a few steps: checks the plumbing only")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def config(args: argparse.Namespace, method: str, seed: int) -> RunConfig:
    """Same task, seed, inner loop and schedule for every method. DiLoCo keeps its defaults
    (Nesterov lr 0.7, momentum 0.9, mean); SparseLoCo its own (outer SGD lr 1, density
    1.56 %, EF beta 0.95, mean over keepers) plus the --set overrides."""
    overrides = {
        "workers": args.workers, "rounds": args.rounds, "seed": seed,
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_windows": args.val_windows, "inner.steps": args.inner_steps,
        "compression.method": "diloco" if method == "diloco" else "sparseloco",
    }
    if method == "sparseloco":
        overrides.update(dict(item.split("=", 1) for item in args.set))
    return load_config(overrides=overrides)


def adamw_loss(cfg: RunConfig) -> float:
    """One model, the same schedule and the per-step batches of every partition concatenated:
    the same tokens as the distributed runs see, in rounds x H steps."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
    model, inner = task.make_model(), cfg.inner
    opt = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2),
                            weight_decay=inner.weight_decay)
    total = cfg.rounds * inner.steps
    for step in range(total):
        for group in opt.param_groups:
            group["lr"] = lr_at(inner, step, total)
        batches = [task.batch(p, step) for p in range(cfg.workers)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = task.loss(model, (x, y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        opt.step()
    return task.val_loss(model)


def final_loss(job: tuple[str, RunConfig]) -> float:
    method, cfg = job
    return adamw_loss(cfg) if method == "adamw" else simulate(cfg).final_val_loss


def spread(values: list[float]) -> float:
    """The sample standard deviation (0 for one value)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = [(m, s) for s in range(args.seeds) for m in METHODS]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        losses = list(pool.map(final_loss, [(m, config(args, m, s)) for m, s in jobs]))
    table = {m: [loss for (mm, _), loss in zip(jobs, losses, strict=True) if mm == m] for m in METHODS}
    sequences = args.workers * args.rounds * args.inner_steps * args.batch_size
    print(f"model {args.model}, {args.workers} workers, {args.rounds} rounds of H={args.inner_steps}, "
          f"{sequences} sequences of {args.seq_len} bytes per method and seed; SparseLoCo "
          f"{' '.join(args.set) or 'defaults'}")
    print(f"{'seed':<6}" + "".join(f"{m:>12}" for m in METHODS) + f"{'ratio':>9}")
    for s in range(args.seeds):
        row = [table[m][s] for m in METHODS]
        print(f"{s:<6}" + "".join(f"{x:>12.4f}" for x in row) + f"{row[0] / row[1]:>9.4f}")
    mean = {m: statistics.mean(v) for m, v in table.items()}
    sd = {m: spread(v) for m, v in table.items()}
    ratios = [a / b for a, b in zip(table["sparseloco"], table["diloco"], strict=True)]
    print(f"{'mean':<6}" + "".join(f"{mean[m]:>12.4f}" for m in METHODS) + f"{mean['sparseloco'] / mean['diloco']:>9.4f}")
    print(f"{'sd':<6}" + "".join(f"{sd[m]:>12.4f}" for m in METHODS) + f"{spread(ratios):>9.4f}")
    ratio = mean["sparseloco"] / mean["diloco"]
    print(f"ratio SparseLoCo / DiLoCo {ratio:.4f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'}); "
          f"gap to AdamW: SparseLoCo {mean['sparseloco'] - mean['adamw']:+.4f}, "
          f"DiLoCo {mean['diloco'] - mean['adamw']:+.4f}")
    print(json.dumps({
        "sparseloco_loss": round(mean["sparseloco"], 4), "diloco_loss": round(mean["diloco"], 4),
        "adamw_loss": round(mean["adamw"], 4), "sparseloco_sd": round(sd["sparseloco"], 4),
        "diloco_sd": round(sd["diloco"], 4), "adamw_sd": round(sd["adamw"], 4), "ratio": round(ratio, 4),
        "ratio_sd": round(spread(ratios), 4), "sparseloco_over_adamw": round(mean["sparseloco"] / mean["adamw"], 4),
        "seeds": args.seeds, "workers": args.workers,
        "losses": {m: [round(x, 4) for x in v] for m, v in table.items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
