"""Loss parity at equal tokens and seeds: SparseLoCo and dense DiLoCo through the
local launcher, and plain single-process AdamW seeing the same batches (every partition's
batch of a step at once, so the same tokens in rounds x H steps). Prints a table, then one
JSON line with ratio = sparseloco / diloco validation loss (target <= 1.02; the SparseLoCo
paper, Sarfi et al. 2025, arXiv 2508.15706, reports SparseLoCo at or below DiLoCo).
docs/benchmarks.md records the regime and what was tried.

    python -m benchmarks.parity            # gpt-tiny, 4 workers, 20 rounds of H=15
    python -m benchmarks.parity --quick    # 2 workers, 2 rounds of H=2: a smoke test only
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from geoloco.config import RunConfig, load_config
from geoloco.launch import run_local
from geoloco.tasks import build_task
from geoloco.worker.trainer import lr_at

QUICK = {"workers": 2, "rounds": 2, "inner_steps": 2, "seq_len": 16, "batch_size": 2, "val_batches": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inner-steps", type=int, default=15, help="H")
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per worker and inner step")
    p.add_argument("--val-batches", type=int, default=32)
    p.add_argument("--density", type=float, default=64 / 4096, help="SparseLoCo top-k density")
    p.add_argument("--ef-beta", type=float, default=0.95, help="SparseLoCo error-feedback decay")
    p.add_argument("--aggregation", default="mean", choices=("mean", "mean_kept"),
                   help="SparseLoCo: mean of the frames (paper) or per-coordinate mean over keepers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/bench-parity")
    p.add_argument("--quick", action="store_true", help="a few steps: checks the plumbing only")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def config(args: argparse.Namespace, method: str) -> RunConfig:
    """Same task, seed, inner loop and schedule for both methods. DiLoCo keeps its defaults
    (Nesterov lr 0.7, momentum 0.9, mean); SparseLoCo gets outer SGD lr 1 and the chosen
    density, EF decay and aggregation."""
    overrides = {
        "workers": args.workers, "rounds": args.rounds, "seed": args.seed,
        "run_dir": f"{args.run_dir}/{method}", "task.model": args.model,
        "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_batches": args.val_batches, "inner.steps": args.inner_steps,
        "compression.method": method, "network.wan": "unlimited",
        "coordinator.checkpoint_every": 0, "coordinator.deadline_s": 3600.0,
    }
    if method == "sparseloco":
        overrides.update({"compression.density": args.density, "compression.ef_beta": args.ef_beta,
                          "outer.aggregation": args.aggregation})
    return load_config(overrides=overrides)


def distributed_loss(cfg: RunConfig) -> float:
    if not run_local(cfg).ok:
        raise SystemExit(f"the {cfg.compression.method} run failed; see {cfg.run_dir}/logs")
    return json.loads((Path(cfg.run_dir) / "summary.json").read_text())["final_val_loss"]


def adamw_loss(cfg: RunConfig) -> float:
    """One model, the same schedule and the per-step batches of every partition concatenated:
    the same tokens as the distributed runs see, in rounds x H steps."""
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sparse = distributed_loss(config(args, "sparseloco"))
    dense = distributed_loss(config(args, "diloco"))
    adamw = adamw_loss(config(args, "diloco"))
    sequences = args.workers * args.rounds * args.inner_steps * args.batch_size
    print(f"model {args.model}, {args.workers} workers, {args.rounds} rounds of H={args.inner_steps}, "
          f"{sequences} sequences of {args.seq_len} bytes each method; SparseLoCo density "
          f"{args.density:.4f}, EF beta {args.ef_beta}, aggregation {args.aggregation}")
    print(f"{'method':<12}{'val loss':>10}")
    for name, value in (("sparseloco", sparse), ("diloco", dense), ("adamw", adamw)):
        print(f"{name:<12}{value:>10.4f}")
    print(json.dumps({"sparseloco_loss": round(sparse, 4), "diloco_loss": round(dense, 4),
                      "adamw_loss": round(adamw, 4), "ratio": round(sparse / dense, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
