"""Final loss of SparseLoCo and DiLoCo against one setting at a time: top-k density,
inner steps H and the number of workers (Sarfi et al. 2025, arXiv 2508.15706, sweep the
same three). Every run is the round protocol in one process (``benchmarks.inprocess``).

The base point: gpt-tiny, 4 workers, H = 15, density 64/4096 = 1.56 %, 240 inner steps
per worker (16 rounds), batch 8 x 32 bytes, seed 0. The H sweep keeps the inner steps per
worker (so the tokens) equal: 16, 8 and 4 rounds. The workers sweep keeps them per
worker, so more workers see more tokens. DiLoCo does not depend on the density: its
base-point loss is the flat line of that plot.

    python -m benchmarks.sweeps            # 12 runs, ~10-20 min on 2 cores
    python -m benchmarks.sweeps --steps-per-worker 120   # half the tokens, ~7 min
    python -m benchmarks.sweeps --quick    # 2 workers, 2 rounds of H=2: a smoke test, no plots

Prints a table per sweep, writes docs/img/sweep-<name>.png, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.inprocess import simulate
from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


@dataclass(frozen=True)
class Point:
    """One run's settings."""

    method: str
    density: float = 64 / 4096
    inner_steps: int = 15
    workers: int = 4


@dataclass(frozen=True)
class Regime:
    steps_per_worker: int = 240  # inner steps each worker takes over the run
    seq_len: int = 32
    batch_size: int = 8
    val_windows: int = 128
    seed: int = 0


SWEEPS = {
    "density": ("density", [32 / 4096, 64 / 4096, 128 / 4096]),
    "H": ("inner_steps", [15, 30, 60]),
    "workers": ("workers", [2, 4, 8]),
}
QUICK_SWEEPS = {"H": ("inner_steps", [2, 4])}
QUICK = Regime(steps_per_worker=4, seq_len=16, batch_size=2, val_windows=2)


def config(point: Point, regime: Regime) -> RunConfig:
    return load_config(overrides={
        "workers": point.workers, "rounds": max(1, regime.steps_per_worker // point.inner_steps),
        "seed": regime.seed, "task.seq_len": regime.seq_len, "task.batch_size": regime.batch_size,
        "task.val_windows": regime.val_windows, "inner.steps": point.inner_steps,
        "compression.method": point.method, "compression.density": point.density,
    })


def points(sweeps: dict) -> list[Point]:
    """Every distinct run the sweeps need (DiLoCo once per value that changes it)."""
    out: list[Point] = []
    for field_name, values in sweeps.values():
        for v in values:
            for method in ("sparseloco", "diloco"):
                p = Point(method) if method == "diloco" and field_name == "density" else replace(Point(method), **{field_name: v})
                if p not in out:
                    out.append(p)
    return out


def run_point(job: tuple[Point, Regime]) -> float:
    point, regime = job
    return simulate(config(point, regime)).tail_val_loss()


def sweep_rows(sweeps: dict, loss: dict[Point, float]) -> dict[str, list[dict]]:
    rows = {}
    for name, (field_name, values) in sweeps.items():
        rows[name] = []
        for v in values:
            sparse = loss[replace(Point("sparseloco"), **{field_name: v})]
            dense = loss[Point("diloco") if field_name == "density" else replace(Point("diloco"), **{field_name: v})]
            rows[name].append({"value": v, "sparseloco": sparse, "diloco": dense, "ratio": sparse / dense})
    return rows


def label(name: str, v: float) -> str:
    return f"{100 * v:.2f} %" if name == "density" else str(v)


def table(name: str, rows: list[dict]) -> str:
    lines = [f"sweep {name}", f"{name:>10}{'sparseloco':>12}{'diloco':>10}{'ratio':>8}"]
    lines += [f"{label(name, r['value']):>10}{r['sparseloco']:>12.4f}{r['diloco']:>10.4f}{r['ratio']:>8.3f}"
              for r in rows]
    return "\n".join(lines)


def plot(name: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [100 * r["value"] if name == "density" else r["value"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(x, [r["sparseloco"] for r in rows], "o-", label="SparseLoCo")
    ax.plot(x, [r["diloco"] for r in rows], "s--", label="DiLoCo")
    ax.set(xlabel={"density": "top-k density (%)", "H": "inner steps H (equal tokens)",
                   "workers": "workers (equal steps per worker)"}[name],
           ylabel="final validation loss", title=f"gpt-tiny: loss against {name}")
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny runs, no plots: checks the plumbing only")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one core each)")
    p.add_argument("--img-dir", type=Path, default=IMG)
    p.add_argument("--steps-per-worker", type=int, default=Regime.steps_per_worker,
                   help="inner steps each worker takes over a run (a multiple of 60 keeps every H whole)")
    args = p.parse_args(argv)
    sweeps, regime = (QUICK_SWEEPS, QUICK) if args.quick else (SWEEPS, Regime(steps_per_worker=args.steps_per_worker))
    todo = points(sweeps)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        loss = dict(zip(todo, pool.map(run_point, [(pt, regime) for pt in todo]), strict=True))
    rows = sweep_rows(sweeps, loss)
    print(f"{len(todo)} runs: gpt-tiny, {regime.steps_per_worker} inner steps per worker, batch "
          f"{regime.batch_size}x{regime.seq_len}, seed {regime.seed}; base: 4 workers, H=15, density 1.56 %")
    for name, r in rows.items():
        print(table(name, r))
        if not args.quick:
            plot(name, r, args.img_dir / f"sweep-{name}.png")
    print(json.dumps({**{name: [{k: round(v, 4) for k, v in row.items()} for row in r] for name, r in rows.items()},
                      **provenance(config(todo[0], regime).task)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
