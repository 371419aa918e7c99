"""``geoloco report``: PNG plots (matplotlib) and a Markdown summary of one or more run
directories: loss against wall time and against bytes sent with the runs overlaid, and per
run the workers' compute/send/wait timeline, the bytes of each round and each round's time
against its limit (metrics.jsonl fields: geoloco.coordinator.metrics)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from geoloco.progress import number, size
from geoloco.run_dir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, write_atomic

REPORT_DIR = "report"
REPORT_FILE = "report.md"
# one colour per run, in RUN_DIR order (the tests look for them in the PNGs)
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
PHASE_COLORS = {"compute": "#4c72b0", "send": "#dd8452", "wait": "#c7c7c7"}
MISSING_COLOR = "#f0c0c0"
DPI = 80
FIGSIZE = (8, 4.5)


class ReportError(Exception):
    """A run directory that cannot be reported on; the message says which and why."""


@dataclass
class Run:
    """One run directory's rounds (metrics.jsonl), config.json and summary.json."""

    name: str
    path: Path
    rounds: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, name: str | None = None) -> Run:
        metrics = path / METRICS_FILE
        if not metrics.is_file():
            raise ReportError(f"{path}: no metrics.jsonl (is it a run directory?)")
        try:
            rounds = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ReportError(f"{metrics}: line {exc.lineno} is not JSON ({exc.msg})") from None
        if not rounds:
            raise ReportError(f"{metrics}: no round has closed yet")
        return cls(name or path.resolve().name, path, rounds, _read_json(path / CONFIG_FILE),
                   _read_json(path / SUMMARY_FILE))

    @property
    def elapsed(self) -> list[float]:
        """Each round's end in seconds since the run started (summed round times for runs
        whose lines predate the elapsed_seconds field)."""
        summed = list(accumulate(m.get("round_seconds") or 0.0 for m in self.rounds))
        return [m["elapsed_seconds"] if m.get("elapsed_seconds") is not None else s
                for m, s in zip(self.rounds, summed, strict=True)]

    @property
    def bytes_sent(self) -> list[float]:
        """Upload bytes per worker, summed over the rounds so far."""
        return list(accumulate(m.get("upload_bytes_per_worker") or 0.0 for m in self.rounds))

    @property
    def deadline_s(self) -> float | None:
        return self.config.get("coordinator", {}).get("deadline_s")

    @property
    def method(self) -> str:
        return self.config.get("compression", {}).get("method", "?")


def write_report(run_dirs: list[Path], out: Path | None = None, labels: list[str] | None = None) -> Path:
    """Plots and report.md for ``run_dirs`` in ``out`` (default: the first run's report/
    folder); returns the path of report.md."""
    labels = labels or []
    if len(labels) > len(run_dirs):
        raise ReportError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [Run.load(Path(d), labels[i] if i < len(labels) else None) for i, d in enumerate(run_dirs)]
    if len({r.name for r in runs}) < len(runs):
        raise ReportError("two runs have the same name; give each a --label")
    out = Path(out) if out is not None else Path(run_dirs[0]) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    images = {"loss against wall time": plot_loss(plt, runs, out / "loss-vs-time.png", "time"),
              "loss against bytes sent": plot_loss(plt, runs, out / "loss-vs-bytes.png", "bytes")}
    per_run = {r.name: {"worker timeline": plot_timeline(plt, r, out / f"{_slug(r.name)}-timeline.png"),
                        "bytes per round": plot_bytes(plt, r, out / f"{_slug(r.name)}-bytes.png"),
                        "round time and its limit": plot_round_time(plt, r, out / f"{_slug(r.name)}-round-time.png")}
               for r in runs}
    report = out / REPORT_FILE
    write_atomic(report, markdown(runs, images, per_run, out), durable=False)
    return report


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ReportError("geoloco report needs matplotlib: pip install 'geoloco[report]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_loss(plt: Any, runs: list[Run], path: Path, against: str) -> Path:
    """Validation loss (solid) and mean train loss (dotted) of every run, against the
    elapsed wall time or the bytes each worker sent (loss_series); the start-up is a thin
    dashed line."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for run, color in zip(runs, RUN_COLORS * len(runs), strict=False):
        for key, style, label in (("val_loss", "-", "val"), ("train_loss", ":", "train")):
            start_up, points = loss_series(run, key, against)
            if start_up:
                ax.plot(*zip(*start_up, strict=True), "--", color=color, linewidth=0.8)
            if points:
                name = run.name if run.method in run.name else f"{run.name} ({run.method})"
                ax.plot(*zip(*points, strict=True), style, color=color, linewidth=2,
                        label=f"{name} {label}")
    if against == "bytes":
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker (cumulative)")
    else:
        ax.set_xlabel("wall time (s)")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def loss_series(run: Run, key: str, against: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(start-up, training) points of ``key`` against ``time`` or ``bytes``. Against time, a
    run from round 0 starts its validation line at round 0's opening with the initial loss,
    and the start-up (the model built, the workers joined) is that loss held flat from the
    run's start: a straight line from the start to round 0's close would draw the start-up
    as slow training."""
    x = run.elapsed if against == "time" else run.bytes_sent
    points = [(xi, m[key]) for xi, m in zip(x, run.rounds, strict=True) if m.get(key) is not None]
    initial = run.summary.get("initial_val_loss")
    if key != "val_loss" or against != "time" or initial is None or run.rounds[0]["round"] != 0:
        return [], points
    opened = max(0.0, x[0] - (run.rounds[0].get("round_seconds") or 0.0))
    return [(0.0, initial), (opened, initial)], [(opened, initial), *points]


def plot_timeline(plt: Any, run: Run, path: Path) -> Path:
    """One row per worker over wall time: each round's compute, send and wait as the
    coordinator saw them; a round that closed without the worker's frame in red."""
    workers = int(run.config.get("workers") or 1 + max(max(m.get("arrived") or [0]) for m in run.rounds))
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for m, end in zip(run.rounds, run.elapsed, strict=True):
        start = end - (m.get("round_seconds") or 0.0)
        for w in range(workers):
            spans = _worker_spans(m, str(w), start, end)
            for left, width, color in spans:
                ax.barh(w, width, left=left, height=0.7, color=color, edgecolor="none")
        ax.axvline(end, color="black", linewidth=0.3, alpha=0.4)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*PHASE_COLORS.values(), MISSING_COLOR)]
    ax.legend(handles, [*PHASE_COLORS, "frame missing"], fontsize=8, loc="upper right")
    ax.set_yticks(range(workers))
    ax.set_yticklabels([f"worker {w}" for w in range(workers)])
    ax.set_xlabel("wall time (s); a line at each round's close")
    ax.set_title(f"{run.name}: where each round's time went")
    return _save(plt, fig, path)


def _worker_spans(m: dict[str, Any], worker: str, start: float, end: float) -> list[tuple[float, float, str]]:
    """(left, width, colour) of one worker's compute, send and wait in round ``m``."""
    if worker not in (m.get("compute_seconds_by_worker") or {}):
        return [(start, end - start, MISSING_COLOR)] if worker not in map(str, m.get("arrived") or []) else []
    spans, left = [], start
    for phase, color in PHASE_COLORS.items():
        width = m[f"{phase}_seconds_by_worker"][worker]
        spans.append((left, width, color))
        left += width
    return spans


def plot_bytes(plt: Any, run: Run, path: Path) -> Path:
    """Each round's upload per worker (bars) and download per worker (line)."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    rounds = [m["round"] for m in run.rounds]
    ax.bar(rounds, [m.get("upload_bytes_per_worker") or 0 for m in run.rounds], color=RUN_COLORS[0],
           label="upload per worker")
    ax.plot(rounds, [m.get("download_bytes_per_worker") or 0 for m in run.rounds], "o-", color=RUN_COLORS[1],
            label="download per worker")
    _label_rounds(ax, "bytes", f"{run.name}: bytes per round")
    return _save(plt, fig, path)


def plot_round_time(plt: Any, run: Run, path: Path) -> Path:
    """Each round's time (bars, by why it closed) against the round deadline."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    reasons = sorted({m.get("close_reason", "?") for m in run.rounds})
    for reason, color in zip(reasons, RUN_COLORS, strict=False):
        picked = [m for m in run.rounds if m.get("close_reason", "?") == reason]
        ax.bar([m["round"] for m in picked], [m.get("round_seconds") or 0 for m in picked], color=color,
               label=f"closed: {reason}")
    if run.deadline_s is not None:
        ax.axhline(run.deadline_s, color="black", linestyle="--", label=f"deadline {run.deadline_s:g} s")
        longest = max(m.get("round_seconds") or 0 for m in run.rounds)
        if run.deadline_s > 4 * longest:  # keep the bars readable; the limit is named
            ax.set_ylim(0, 1.3 * longest)
            ax.text(0.01, 0.95, f"deadline {run.deadline_s:g} s (off the scale)",
                    transform=ax.transAxes, fontsize=8, va="top")
    _label_rounds(ax, "seconds", f"{run.name}: round time against its limit")
    return _save(plt, fig, path)


def _label_rounds(ax: Any, ylabel: str, title: str) -> None:
    """Labels of a plot against the round: whole ticks, numbered from 0 as in metrics.jsonl."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def markdown(runs: list[Run], images: dict[str, Path], per_run: dict[str, dict[str, Path]], out: Path) -> str:
    """report.md: one table row per run, then the images."""
    lines = ["# Run report", "",
             "| run | method | rounds | val loss | wall time | upload / worker / round | vs dense fp32 | mean round |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in runs:
        first, last = r.summary.get("initial_val_loss"), _last(r.rounds, "val_loss")
        seconds = [m.get("round_seconds") or 0.0 for m in r.rounds]
        up = [m.get("upload_bytes_per_worker") or 0.0 for m in r.rounds]
        ratio = r.summary.get("upload_ratio_vs_dense_fp32")
        lines.append(f"| {r.name} | {r.method} | {len(r.rounds)} | {number(first, '.4f')} → {number(last, '.4f')} "
                     f"| {r.elapsed[-1]:.1f} s | {size(sum(up) / len(up))} | {number(ratio, '.4f')} "
                     f"| {sum(seconds) / len(seconds):.2f} s |")
    lines += density_lines(runs)
    lines.append("")
    for title, path in images.items():
        lines += [f"## {title[0].upper()}{title[1:]}", "", f"![{title}]({path.relative_to(out)})", ""]
    for name, plots in per_run.items():
        lines += [f"## {name}", ""]
        for title, path in plots.items():
            lines += [f"![{name}: {title}]({path.relative_to(out)})", ""]
    return "\n".join(lines)


def density_lines(runs: list[Run]) -> list[str]:
    """Each worker's top-k density over the run (first → last, and the range), for runs
    whose metrics carry it (compression.density "auto" varies it per worker)."""
    rows = []
    for r in runs:
        by_worker: dict[str, list[float]] = {}
        for m in r.rounds:
            for worker, density in (m.get("density_by_worker") or {}).items():
                by_worker.setdefault(worker, []).append(density)
        for worker, values in sorted(by_worker.items(), key=lambda item: int(item[0])):
            rows.append(f"| {r.name} | {worker} | {values[0]:.5f} → {values[-1]:.5f} "
                        f"| {min(values):.5f}–{max(values):.5f} |")
    if not rows:
        return []
    return ["", "| run | worker | density first → last | range |", "| --- | ---: | ---: | ---: |", *rows]


def _last(rounds: list[dict[str, Any]], key: str) -> Any:
    return next((m[key] for m in reversed(rounds) if m.get(key) is not None), None)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON ({exc.msg})") from None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
