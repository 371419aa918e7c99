"""Gradient coding against a straggler, measured fairly (Tandon et al. 2017, "Gradient
Coding"; the pipelined variant: docs/gradient-coding.md).

Each run is a real ``geoloco local`` job (coordinator + n worker processes on loopback,
unlimited links, gpt-tiny, compute-bound rounds). Worker 0 is 4x slower in every other
block of ``BLOCK`` rounds (straggler profile ``blocks:4:BLOCK``) and as fast as the others
in the rest, so every run measures its own no-straggler rounds beside its straggler
rounds, under the same machine load: ``x base`` is the mean straggler round over the mean
no-straggler round of the same run. The straggler spends its extra time computing (the
worker's ``occupy``), so its core stays busy as a slower worker's compute would. Round 0
(first codec calls; pipelined: the warm-up on every held partition) and the first round
after each slow block (the straggler may still be finishing) are left out of the means.

Cases: n = 4, s = 1; n = 8, s = 1; seeds 0..SEEDS-1 each (model init and data); schemes
``none`` (wait for all), ``pgc-fr`` and ``quorum`` (close on the (n - s)-th frame, late
work dropped: the configured defaults of the baseline that drops late work) by default.
The loss figure is the final validation loss after the same rounds, relative to ``none``
of the same case and seed. The load average is recorded beside each run.

    .venv/bin/python -m benchmarks.stragglers            # 30 runs of 16 rounds, ~2 h on a busy 2-core machine
    .venv/bin/python -m benchmarks.stragglers --rounds 8 --block 2 --seeds 3   # about a quarter of that
    .venv/bin/python -m benchmarks.stragglers --quick    # smoke test: 2 workers, 6 rounds

Prints a table per case (mean and sample standard deviation over seeds), writes a PNG of
round times, and ends with one JSON line. Targets: ``pgc-fr`` x base <= 1.15 at n = 4 and
n = 8; its loss within 2 % of ``none``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.parity import paired_bounds
from benchmarks.provenance import provenance
from geoloco.config import SCHEMES, load_config

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "img" / "stragglers.png"
RUN_TIMEOUT_S = 900
ROUND_TARGET = 1.15
LOSS_TARGET = 0.02


@dataclass(frozen=True)
class Settings:
    cases: tuple[tuple[int, int], ...]  # (n, s)
    rounds: int
    block: int  # rounds per block: fast, slow, fast, slow, ...
    inner_steps: int
    seeds: int
    factor: float = 4.0


# gpt-tiny, 32-token sequences, batches of 8: one partition's H = 8 steps take ~0.5-1 s on
# a busy core, well above the round's fixed costs (validation, codec, loopback gRPC).
FULL = Settings(cases=((4, 1), (8, 1)), rounds=16, block=4, inner_steps=8, seeds=5)
QUICK = Settings(cases=((2, 1),), rounds=6, block=2, inner_steps=2, seeds=1)
TASK = {
    "task.model": "gpt-tiny", "task.seq_len": "32", "task.batch_size": "8",
    "task.val_windows": "32", "task.corpus_bytes": "300000", "inner.warmup_steps": "4",
    "inner.lr": "3e-3", "coordinator.checkpoint_every": "0", "coordinator.deadline_s": "300",
}


@dataclass
class RunResult:
    """One run's per-round figures (metrics.jsonl) and the machine's load around it."""

    scheme: str
    round_seconds: list[float]
    val_loss: list[float]
    load: tuple[float, float]  # 1-minute load average before and after the run

    def is_slow(self, r: int, s: Settings) -> bool:
        return (r // s.block) % 2 == 1

    def split(self, s: Settings) -> tuple[list[float], list[float]]:
        """(no-straggler rounds, straggler rounds), without round 0 and the first round
        after each slow block."""
        fast, slow = [], []
        for r, sec in enumerate(self.round_seconds):
            after_slow = r > 0 and self.is_slow(r - 1, s) and not self.is_slow(r, s)
            if r == 0 or after_slow:
                continue
            (slow if self.is_slow(r, s) else fast).append(sec)
        return fast, slow

    def figures(self, s: Settings) -> dict[str, float]:
        fast, slow = self.split(s)
        return {"base_round_s": float(np.mean(fast)), "straggler_round_s": float(np.mean(slow)),
                "x_base": float(np.mean(slow) / np.mean(fast)), "final_val_loss": self.val_loss[-1]}


def run_scheme(scheme: str, n: int, stragglers: int, seed: int, s: Settings, run_dir: Path) -> RunResult:
    """One ``geoloco local`` run; raises RuntimeError with the log tail when it fails."""
    profiles = ",".join([f"blocks:{s.factor:g}:{s.block}"] + ["none"] * (n - 1))
    args = [sys.executable, "-m", "geoloco.cli", "local", "--workers", str(n), "--rounds", str(s.rounds),
            "--wan", "unlimited", "--run-dir", str(run_dir), "--scheme", scheme,
            "--stragglers", "0" if scheme == "none" else str(stragglers), "--straggler-profiles", profiles,
            "--inner-steps", str(s.inner_steps), "--stall-timeout", "300", "--set", f"seed={seed}"]
    for key, value in TASK.items():
        args += ["--set", f"{key}={value}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    before = os.getloadavg()[0]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{scheme} n={n} seed={seed} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return RunResult(scheme, [m["round_seconds"] for m in lines], [m["val_loss"] for m in lines],
                     (before, os.getloadavg()[0]))


def diffs_line(d: dict[str, float | None]) -> str:
    if d["upper95"] is None:
        return f"mean {d['mean']:+.4f} (1 seed: no bounds)"
    return f"mean {d['mean']:+.4f}, one-sided 95 % bounds {d['lower95']:+.4f} and {d['upper95']:+.4f} ({d['seeds']} seeds)"


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def case_table(name: str, rows: dict[str, dict[str, tuple[float, float]]]) -> str:
    lines = [name, f"{'scheme':<8}{'base s':>16}{'straggler s':>16}{'x base':>16}{'loss vs none':>18}"]
    for scheme, f in rows.items():
        cells = [f"{f[k][0]:.3f} ± {f[k][1]:.3f}" for k in ("base_round_s", "straggler_round_s", "x_base")]
        loss = f"{100 * f['loss_vs_none'][0]:+.2f} ± {100 * f['loss_vs_none'][1]:.2f}%"
        lines.append(f"{scheme:<8}" + "".join(f"{c:>16}" for c in cells) + f"{loss:>18}")
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, RunResult]], s: Settings, path: Path) -> None:
    """Round times of seed 0, one panel per case; slow blocks shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 3.8), squeeze=False)
    for ax, (case, results) in zip(axes[0], runs.items(), strict=True):
        for r in range(s.rounds):
            if (r // s.block) % 2 == 1:
                ax.axvspan(r - 0.5, r + 0.5, color="0.9")
        for scheme, res in results.items():
            ax.plot(range(len(res.round_seconds)), res.round_seconds, marker=".", label=scheme)
        ax.set(title=f"{case}: worker 0 4x slow in shaded rounds", xlabel="round", ylabel="round seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(s: Settings, work: Path, schemes: list[str], plot_path: Path | None) -> dict[str, object]:
    out: dict[str, object] = {}
    first_seed: dict[str, dict[str, RunResult]] = {}
    for n, stragglers in s.cases:
        case = f"n={n} s={stragglers}"
        per_seed: dict[str, list[dict[str, float]]] = {k: [] for k in schemes}
        loads = []
        for seed in range(s.seeds):
            results = {}
            for scheme in schemes:  # the schemes of one seed back to back: the same load
                results[scheme] = run_scheme(scheme, n, stragglers, seed, s, work / f"{case}-{scheme}-{seed}")
                loads += list(results[scheme].load)
                f = results[scheme].figures(s)
                print(f"  {case} seed {seed} {scheme:<7} x base {f['x_base']:.3f} (round {f['base_round_s']:.2f}s "
                      f"-> {f['straggler_round_s']:.2f}s), val loss {f['final_val_loss']:.4f}, load "
                      f"{results[scheme].load[0]:.1f}-{results[scheme].load[1]:.1f}", flush=True)
            for scheme in schemes:
                f = results[scheme].figures(s)
                f["loss_vs_none"] = f["final_val_loss"] / results["none"].figures(s)["final_val_loss"] - 1
                per_seed[scheme].append(f)
            first_seed.setdefault(case, results)
        rows = {scheme: {k: mean_sd([f[k] for f in fs]) for k in fs[0]} for scheme, fs in per_seed.items()}
        print(case_table(f"{case}, {s.seeds} seeds (mean ± sd), load average {min(loads):.1f}-{max(loads):.1f}",
                         rows), flush=True)
        out[case] = {scheme: {k: [round(v[0], 4), round(v[1], 4)] for k, v in r.items()} for scheme, r in rows.items()}
        out[case]["load_average"] = [round(min(loads), 2), round(max(loads), 2)]
        if {"pgc-fr", "quorum"} <= set(schemes):
            diffs = [a["final_val_loss"] - b["final_val_loss"]
                     for a, b in zip(per_seed["pgc-fr"], per_seed["quorum"], strict=True)]
            out[case]["pgc_fr_minus_quorum"] = paired_bounds(diffs)
            print(f"pgc-fr - quorum, final val loss paired by seed: {diffs_line(out[case]['pgc_fr_minus_quorum'])}",
                  flush=True)
    if plot_path is not None:
        plot(first_seed, s, plot_path)
        print(f"# plot: {plot_path}", flush=True)
    return out


def parse_schemes(text: str) -> list[str]:
    schemes = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown or "none" not in schemes:
        raise SystemExit(f"--schemes: a subset of {', '.join(SCHEMES)} that includes none")
    return ["none"] + [x for x in schemes if x != "none"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings (smoke test), no plot")
    parser.add_argument("--schemes", default="none,pgc-fr,quorum",
                        help="comma-separated schemes, none included (default: none,pgc-fr,quorum)")
    parser.add_argument("--seeds", type=int, help=f"seeds per case (default {FULL.seeds})")
    parser.add_argument("--rounds", type=int, help=f"rounds per run (default {FULL.rounds})")
    parser.add_argument("--block", type=int, help=f"rounds per fast or slow block (default {FULL.block})")
    parser.add_argument("--work-dir", type=Path, help="keep the run directories here")
    parser.add_argument("--plot", type=Path, default=PLOT, help=f"PNG to write (default {PLOT})")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    settings = replace(settings, **{k: v for k, v in (("seeds", args.seeds), ("rounds", args.rounds),
                                                       ("block", args.block)) if v})
    if settings.block < 2 or settings.rounds < 2 * settings.block:
        parser.error("--block must be >= 2 and --rounds >= 2 x --block (fast rounds, then a slow block)")
    with tempfile.TemporaryDirectory(prefix="geoloco-stragglers-") as tmp:
        work = args.work_dir or Path(tmp)
        result = run(settings, work, parse_schemes(args.schemes), None if args.quick else args.plot)
    print(json.dumps({**result, **provenance(load_config(overrides=TASK).task)}, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
