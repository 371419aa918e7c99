"""Gradient coding against stragglers, all six schemes side by side (Tandon et al. 2017,
"Gradient Coding"; Su and Li 2026, "Pipelined gradient coding", arXiv 2607.20739).

Each run is a real ``geoloco local`` job (coordinator + n worker processes on loopback,
unlimited links, gpt-tiny): first with one worker slowed 4x (``fixed:4``), then with every
worker drawing a shifted-exponential extra delay, and once without stragglers (``none``)
for ``no_straggler_round_s``. The regime is compute-bound so that the slow-down matters.

    .venv/bin/python -m benchmarks.stragglers            # ~6-10 min on 2 cores
    .venv/bin/python -m benchmarks.stragglers --quick    # smoke test: tiny settings

Prints a table per straggler model, writes a PNG of validation loss against wall time,
and ends with one JSON line keyed by scheme (figures of the fixed:4 model, the
shifted-exponential ones nested under ``shifted_exponential``) plus
``no_straggler_round_s``. Round times, wall time and ``partitions_per_worker_round``
are taken after round 0, which pays the workers' one-time costs (first compression call,
allocator warm-up) and, pipelined, the warm-up on all held partitions.
``partitions_per_worker_round`` is the steady state: the mean
over rounds 1.. of the partitions each arrived worker trained (round 0 of a pipelined
scheme is the warm-up on all s + 1). ``loss_equal_time`` interpolates each run's
validation loss at the wall time of the shortest run of the same straggler model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from geoloco.config import SCHEMES

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "img" / "stragglers.png"
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Settings:
    """One benchmark size: the model's task settings and the straggler models."""

    workers: int
    rounds: int
    inner_steps: int
    models: dict[str, str]  # model name -> straggler profile of every worker
    slow: str = "fixed:4"  # the profile of worker 0 in the ``fixed`` model

    def profiles(self, model: str) -> str:
        if model == "fixed":
            return ",".join([self.slow] + ["none"] * (self.workers - 1))
        return ",".join([self.models[model]] * self.workers)


# gpt-tiny, 32-token sequences, batches of 8: one partition's H = 8 steps take ~0.5-1 s on
# a busy core, well above the round's fixed costs (validation, codec, loopback gRPC).
FULL = Settings(workers=4, rounds=10, inner_steps=8,
                models={"fixed": "", "shifted_exponential": "exp:0.1:1.0"})
QUICK = Settings(workers=2, rounds=2, inner_steps=2, models={"fixed": ""})
TASK = {
    "task.model": "gpt-tiny", "task.seq_len": "32", "task.batch_size": "8",
    "task.val_batches": "4", "task.corpus_bytes": "300000", "inner.warmup_steps": "4",
    "inner.lr": "3e-3", "coordinator.checkpoint_every": "0", "coordinator.deadline_s": "300",
}


@dataclass
class RunResult:
    """One run's per-round figures, read from its metrics.jsonl and summary.json."""

    scheme: str
    round_seconds: list[float]
    val_loss: list[float]
    partitions: list[float]  # per round: mean partitions trained by the arrived workers

    @property
    def steady_seconds(self) -> np.ndarray:
        """Round seconds after round 0 (round 0 also pays the workers' first-call costs)."""
        return np.asarray(self.round_seconds[1:] or self.round_seconds)

    @property
    def wall(self) -> np.ndarray:
        """Seconds since round 1 opened at the end of rounds 0, 1, ... (back to back)."""
        return np.concatenate([[0.0], np.cumsum(self.round_seconds[1:])])

    def loss_at(self, seconds: float) -> float:
        return float(np.interp(seconds, self.wall, self.val_loss))

    def figures(self, equal_time_s: float) -> dict[str, float]:
        rs = self.steady_seconds
        return {"round_s_mean": float(rs.mean()), "round_s_p95": float(np.percentile(rs, 95)),
                "partitions_per_worker_round": float(np.mean(self.partitions[1:] or self.partitions)),
                "loss_equal_rounds": self.val_loss[-1], "loss_equal_time": self.loss_at(equal_time_s)}


def run_scheme(scheme: str, profiles: str, s: Settings, run_dir: Path, reuse: bool = False) -> RunResult:
    """One ``geoloco local`` run; raises RuntimeError with the log tail when it fails."""
    stragglers = "0" if scheme == "none" else "1"
    args = [sys.executable, "-m", "geoloco.cli", "local", "--workers", str(s.workers),
            "--rounds", str(s.rounds), "--wan", "unlimited", "--run-dir", str(run_dir),
            "--scheme", scheme, "--stragglers", stragglers, "--straggler", profiles,
            "--inner-steps", str(s.inner_steps), "--stall-timeout", "300"]
    for key, value in TASK.items():
        args += ["--set", f"{key}={value}"]
    if reuse and (run_dir / "summary.json").exists():
        return read_run(scheme, run_dir)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{scheme} ({profiles}) failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return read_run(scheme, run_dir)


def read_run(scheme: str, run_dir: Path) -> RunResult:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return RunResult(scheme, [m["round_seconds"] for m in lines], [m["val_loss"] for m in lines],
                     [m["partitions_per_worker_round"] for m in lines])


def run_model(model: str, s: Settings, work: Path, schemes: list[str], reuse: bool) -> dict[str, RunResult]:
    profiles = s.profiles(model)
    print(f"# {model}: straggler profiles {profiles}", flush=True)
    results = {}
    for scheme in schemes:
        results[scheme] = run_scheme(scheme, profiles, s, work / f"{model}-{scheme}", reuse)
        r = results[scheme]
        print(f"  {scheme:<7} {len(r.round_seconds)} rounds, {r.wall[-1]:.1f}s after round 0, "
              f"val loss {r.val_loss[-1]:.4f}", flush=True)
    return results


def model_figures(results: dict[str, RunResult]) -> dict[str, dict[str, float]]:
    """Per scheme, with the equal-time loss taken at the shortest run's wall time."""
    equal_time = min(r.wall[-1] for r in results.values())
    return {scheme: r.figures(equal_time) for scheme, r in results.items()}


def table(model: str, figures: dict[str, dict[str, float]], baseline_s: float) -> str:
    rows = [f"{model} (no-straggler round {baseline_s:.2f}s)",
            f"{'scheme':<8}{'round s':>9}{'p95 s':>8}{'x base':>8}{'parts/w/r':>11}"
            f"{'loss@rounds':>13}{'loss@time':>11}"]
    for scheme, f in figures.items():
        rows.append(f"{scheme:<8}{f['round_s_mean']:>9.2f}{f['round_s_p95']:>8.2f}"
                    f"{f['round_s_mean'] / baseline_s:>8.2f}{f['partitions_per_worker_round']:>11.2f}"
                    f"{f['loss_equal_rounds']:>13.4f}{f['loss_equal_time']:>11.4f}")
    return "\n".join(rows)


def plot(runs: dict[str, dict[str, RunResult]], baseline: RunResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.2), squeeze=False)
    for ax, (model, results) in zip(axes[0], runs.items(), strict=True):
        for scheme, r in results.items():
            ax.plot(r.wall, r.val_loss, marker=".", label=scheme)
        ax.plot(baseline.wall, baseline.val_loss, "k--", label="none, no straggler")
        ax.set(title=f"stragglers: {model}", xlabel="wall time after round 0 (s)",
               ylabel="validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(s: Settings, work: Path, plot_path: Path | None, schemes: list[str],
        reuse: bool = False) -> dict[str, object]:
    baseline = run_scheme("none", ",".join(["none"] * s.workers), s, work / "baseline", reuse)
    baseline_s = float(np.mean(baseline.steady_seconds))
    print(f"# no stragglers, scheme none: mean round {baseline_s:.2f}s", flush=True)
    runs = {model: run_model(model, s, work, schemes, reuse) for model in s.models}
    figures = {model: model_figures(results) for model, results in runs.items()}
    for model, f in figures.items():
        print(table(model, f, baseline_s), flush=True)
    if plot_path is not None:
        plot(runs, baseline, plot_path)
        print(f"# plot: {plot_path}", flush=True)
    out: dict[str, object] = {}
    for scheme in schemes:
        entry = dict(figures["fixed"][scheme])
        for model in s.models:
            if model != "fixed":
                entry[model] = figures[model][scheme]
        out[scheme] = entry
    out["no_straggler_round_s"] = baseline_s
    return out


def parse_schemes(text: str) -> list[str]:
    schemes = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown or not schemes:
        raise SystemExit(f"--schemes: {unknown or text!r} not among {', '.join(SCHEMES)}")
    return schemes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings (smoke test), no plot")
    parser.add_argument("--schemes", default=",".join(SCHEMES),
                        help="comma-separated subset of the schemes (default: all six)")
    parser.add_argument("--work-dir", type=Path, help="keep the run directories here")
    parser.add_argument("--models", help="comma-separated straggler models (default: all; fixed first)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --work-dir: read runs that already finished there instead of rerunning")
    parser.add_argument("--plot", type=Path, default=PLOT, help=f"PNG to write (default {PLOT})")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.models:
        models = [m.strip() for m in args.models.split(",")]
        if "fixed" not in models or not set(models) <= set(FULL.models):
            raise SystemExit(f"--models: a subset of {', '.join(FULL.models)} that includes fixed")
        settings = replace(settings, models={m: FULL.models[m] for m in models})
    with tempfile.TemporaryDirectory(prefix="geoloco-stragglers-") as tmp:
        work = args.work_dir or Path(tmp)
        result = run(settings, work, None if args.quick else args.plot, parse_schemes(args.schemes),
                     args.reuse)
    print(json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
