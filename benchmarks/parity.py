"""Loss parity at equal tokens: SparseLoCo against dense DiLoCo and single-process AdamW,
each at tuned settings, paired over fresh seeds (the SparseLoCo paper, Sarfi et al. 2025,
arXiv 2508.15706, reports SparseLoCo at or below DiLoCo). The distributed runs are the
round protocol in one process (``benchmarks.inprocess``: the same parameters, bit for bit,
as ``geoloco local``); AdamW is one model taking every partition's batch of a step at
once, so the same tokens in rounds x H steps. A run's loss is the mean validation loss of
its last 5 rounds. docs/benchmarks.md records the regime and the figures.

Two stages, never on the same seeds:
- ``--tune`` (seeds 100, 101): per method, the inner AdamW lr over a grid at the method's
  default outer lr, then the outer lr over a grid at the best inner lr (AdamW has only
  the first); the lowest mean loss wins. Writes benchmarks/parity_tuned.json.
- evaluation (seeds 0 .. SEEDS-1): DiLoCo and AdamW at the tuned settings, SparseLoCo at
  its defaults (the primary arm; ``--arms all`` adds 1.56 % and 3.1 % density with each
  quantizer, and SparseLoCo at its own tuned settings). Per SparseLoCo arm: the paired
  per-seed ratios SparseLoCo / DiLoCo, their mean and one-sided 95 % upper bound
  (Student t), the gap to AdamW and the bytes per worker per round. Targets: mean <= 1.00,
  upper bound <= 1.02, upload <= 3 % of dense DiLoCo's bf16 upload.

    python -m benchmarks.parity                  # primary arm, 5 seeds, 8 workers, 60 rounds of H=15
    python -m benchmarks.parity --tune           # the tuning stage
    python -m benchmarks.parity --arms all       # every SparseLoCo arm
    python -m benchmarks.parity --quick          # 2 workers, 3 rounds of H=2: a smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.inprocess import VAL_TAIL, simulate
from benchmarks.provenance import provenance
from geoloco.compression import Layout, encode_dense
from geoloco.config import RunConfig, load_config
from geoloco.schedule import lr_at
from geoloco.tasks import build_task

TUNED_FILE = Path(__file__).with_name("parity_tuned.json")
CACHE_DIR = Path("runs/parity-cache")
TARGET_MEAN, TARGET_UPPER, TARGET_UPLOAD = 1.00, 1.02, 0.03
METHODS = ("sparseloco", "diloco", "adamw")
TUNE_SEEDS = (100, 101)
# the order tuning trains in: DiLoCo, the baseline the evaluation most depends on, first;
# SparseLoCo, whose primary arm keeps its defaults, last
TUNE_ORDER = ("diloco", "adamw", "sparseloco")
INNER_LRS = (1.5e-3, 3e-3, 6e-3)
OUTER_LRS = {"sparseloco": (0.5, 0.75, 1.0), "diloco": (0.2, 0.35, 0.5, 0.7)}
# SparseLoCo arms: the settings each names (over --sparseloco-set); "tuned": the tuned file's
ARMS = {
    "sparseloco": {},
    "sparseloco-1.56-four-bin": {"compression.quantizer": "four-bin"},
    "sparseloco-3.1-two-level": {"compression.density": 128 / 4096},
    "sparseloco-3.1-four-bin": {"compression.density": 128 / 4096, "compression.quantizer": "four-bin"},
    "sparseloco-tuned": {},
}
PRIMARY = ("sparseloco",)
# one-sided 95 % quantiles of Student's t, t_{0.95, df} for df = 1 .. 30
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771,
       1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706,
       1.703, 1.701, 1.699, 1.697)
QUICK = {"workers": 2, "rounds": 3, "inner_steps": 2, "seq_len": 16, "batch_size": 2, "val_windows": 8,
         "seeds": 2, "inner_lrs": "3e-3,6e-3", "sparseloco_outer_lrs": "0.5,1", "diloco_outer_lrs": "0.35,0.7"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--inner-steps", type=int, default=15, help="H")
    p.add_argument("--warmup", type=float, default=0.15, help="warm-up, a fraction of all inner steps")
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per worker and inner step")
    p.add_argument("--val-windows", type=int, default=1024, help="held-out validation windows")
    p.add_argument("--partitioning", default="iid", help="task.partitioning: iid | contiguous")
    p.add_argument("--seeds", type=int, default=5, help="evaluation seeds 0 .. SEEDS-1")
    p.add_argument("--arms", default="primary",
                   help=f"primary | all | a comma-separated list of {', '.join(ARMS)}")
    for method in METHODS:
        p.add_argument(f"--{method}-set", action="append", default=[], metavar="FIELD=VALUE",
                       help=f"a config override of every {method} run, over the tuned settings (repeatable)")
    p.add_argument("--set", dest="sparseloco_set_old", action="append", default=[], metavar="FIELD=VALUE",
                   help="the same as --sparseloco-set (kept for older command lines)")
    p.add_argument("--tuned", default=str(TUNED_FILE),
                   help="the tuned settings the evaluation reads ('none': every method at its defaults)")
    p.add_argument("--tune", action="store_true", help="run the tuning stage and write --tuned")
    p.add_argument("--tune-seeds", default=",".join(map(str, TUNE_SEEDS)))
    p.add_argument("--tune-rounds", type=int, default=None, help="rounds of a tuning run (default --rounds)")
    p.add_argument("--tune-fresh", action="store_true",
                   help="train every grid point (by default the points of --tuned, if tuned in the same regime, are kept)")
    p.add_argument("--inner-lrs", default=",".join(map(str, INNER_LRS)), help="the inner lr grid")
    for method, grid in OUTER_LRS.items():
        p.add_argument(f"--{method}-outer-lrs", default=",".join(map(str, grid)), help=f"{method}'s outer lr grid")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one core each)")
    p.add_argument("--cache", default=None,
                   help=f"a folder of finished runs, by config: a run found there is not trained again "
                        f"(default {CACHE_DIR}, with --quick none; 'none': off)")
    p.add_argument("--only", default=None, metavar="LABELS",
                   help="train only these comma-separated labels (diloco, adamw, an arm) into the cache, no report")
    p.add_argument("--quick", action="store_true", help="a few steps: checks the plumbing only")
    args = p.parse_args(argv)
    args.sparseloco_set += args.sparseloco_set_old
    if args.cache is None:
        args.cache = "none" if args.quick else str(CACHE_DIR)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def pairs(items: list[str]) -> dict[str, str]:
    """FIELD=VALUE items as a dict (ValueError naming the item without '=')."""
    bad = [item for item in items if "=" not in item]
    if bad:
        raise ValueError(f"{bad[0]!r} is not FIELD=VALUE")
    return dict(item.split("=", 1) for item in items)


@dataclass(frozen=True)
class Job:
    """One training run: a method, its config overrides and a seed."""

    label: str  # the arm (or tuning point) the run belongs to
    method: str  # sparseloco | diloco | adamw
    overrides: dict[str, Any]
    seed: int


def base_overrides(args: argparse.Namespace, rounds: int) -> dict[str, Any]:
    """The task, the size of the run and the warm-up, the same for every method."""
    return {
        "workers": args.workers, "rounds": rounds, "task.model": args.model, "task.seq_len": args.seq_len,
        "task.batch_size": args.batch_size, "task.val_windows": args.val_windows,
        "task.partitioning": args.partitioning,
        "inner.steps": args.inner_steps, "inner.warmup_steps": round(args.warmup * rounds * args.inner_steps),
    }


def run_config(job: Job) -> RunConfig:
    method = "diloco" if job.method == "diloco" else "sparseloco"
    return load_config(overrides={**job.overrides, "seed": job.seed, "compression.method": method})


def settings(cfg: RunConfig, method: str) -> dict[str, Any]:
    """What a method's runs were trained with, for the report."""
    inner = {"inner.lr": cfg.inner.lr, "inner.warmup_steps": cfg.inner.warmup_steps,
             "inner.steps": cfg.inner.steps, "inner.min_lr_ratio": cfg.inner.min_lr_ratio,
             "inner.weight_decay": cfg.inner.weight_decay}
    if method == "adamw":
        return inner
    outer = {"outer.lr": cfg.outer.lr, "outer.momentum": cfg.outer.momentum}
    if method == "diloco":
        return {**inner, **outer, "compression.dense_dtype": cfg.compression.dense_dtype}
    comp = cfg.compression
    return {**inner, **outer, "outer.aggregation": cfg.outer.aggregation, "compression.density": comp.density,
            "compression.quantizer": comp.quantizer, "compression.ef_beta": comp.ef_beta}


def adamw_run(cfg: RunConfig, tail: int = VAL_TAIL) -> float:
    """One model, the same schedule and the per-step batches of every partition concatenated
    (the same tokens as the distributed runs, in rounds x H steps); the mean validation
    loss after the steps that end the last ``tail`` rounds."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
    model, inner = task.make_model(), cfg.inner
    opt = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2),
                            weight_decay=inner.weight_decay)
    total = cfg.rounds * inner.steps
    losses = []
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
        if (step + 1) % inner.steps == 0 and step + 1 > (cfg.rounds - tail) * inner.steps:
            losses.append(task.val_loss(model))
    return sum(losses) / len(losses)


def run_job(job: Job) -> dict[str, Any]:
    """Train one job: its loss (the mean of the last rounds'), upload bytes, wall time."""
    start = time.monotonic()
    cfg = run_config(job)
    if job.method == "adamw":
        loss, upload = adamw_run(cfg), None
    else:
        result = simulate(cfg)
        loss, upload = result.tail_val_loss(), statistics.mean(result.upload_bytes)
    return {"loss": loss, "upload": upload, "seconds": time.monotonic() - start}


def cache_path(cache: str, job: Job) -> Path | None:
    """Where ``job``'s result is kept: a hash of everything that decides it (the resolved
    config, the method, the validation tail)."""
    if cache == "none":
        return None
    what = json.dumps({"method": job.method, "config": run_config(job).to_dict(), "val_tail": VAL_TAIL},
                      sort_keys=True)
    return Path(cache) / f"{hashlib.sha256(what.encode()).hexdigest()[:24]}.json"


def run_cached(job: Job, cache: str) -> dict[str, Any]:
    """``run_job``, or its result from the cache; a new result is written there."""
    path = cache_path(cache, job)
    if path is not None and path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    result = run_job(job)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**result, "label": job.label, "seed": job.seed}))
        tmp.replace(path)
    return result


def run_all(jobs: list[Job], n_jobs: int, cache: str = "none") -> list[dict[str, Any]]:
    """Every job, ``n_jobs`` at a time, one process each; printed in job order."""
    with ProcessPoolExecutor(max_workers=n_jobs) as pool:
        futures = [pool.submit(run_cached, job, cache) for job in jobs]
        out = []
        for job, future in zip(jobs, futures, strict=True):
            r = future.result()
            how = "cached" if r.get("cached") else f"{r['seconds']:.0f} s"
            print(f"  {job.label:<34} seed {job.seed:<4} loss {r['loss']:.4f}  ({how})", flush=True)
            out.append(r)
    return out


def upper95(values: list[float]) -> float:
    """One-sided 95 % upper confidence bound of the mean: mean + t_{0.95, n-1} sd / sqrt(n)
    (Student t over the seeds; infinite for one value)."""
    n = len(values)
    if n < 2:
        return math.inf
    t = T95[n - 2] if n - 1 <= len(T95) else 1.645
    return statistics.mean(values) + t * statistics.stdev(values) / math.sqrt(n)


def paired_bounds(diffs: list[float]) -> dict[str, float | None]:
    """Per-seed paired differences: their mean, count and one-sided 95 % bounds (Student t,
    upper95 each way; None from one seed)."""
    bounds = (-upper95([-d for d in diffs]), upper95(diffs)) if len(diffs) > 1 else (None, None)
    return {"mean": round(statistics.mean(diffs), 5), "seeds": len(diffs),
            **{k: None if v is None else round(v, 5) for k, v in zip(("lower95", "upper95"), bounds, strict=True)}}


def dense_bf16_bytes(cfg: RunConfig) -> int:
    """Bytes of one dense bf16 frame of the model: dense DiLoCo's upload per worker and
    round in bf16."""
    model = build_task(cfg.task, cfg.workers, seed=cfg.seed).make_model()
    layout = Layout.from_named_tensors(model.named_parameters())
    return len(encode_dense(layout, [p.detach() for p in model.parameters()], round=0, sender=0, dtype="bf16"))


# the tuning stage -----------------------------------------------------------------------------

def load_tuned(path: str) -> dict[str, dict[str, Any]]:
    """The tuned overrides per method from ``path`` ({} for 'none' or a file not there)."""
    if path == "none" or not Path(path).exists():
        return {}
    return json.loads(Path(path).read_text())["tuned"]


def key(point: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(point.items()))


def tune_points(args: argparse.Namespace, base: dict[str, Any], method: str, points: list[dict[str, Any]],
                seeds: list[int], done: dict[str, list[float]]) -> None:
    """Train ``method`` at every grid point on the tuning seeds; losses into ``done`` (points
    already there are not trained again)."""
    user = pairs(getattr(args, f"{method}_set"))
    jobs = [Job(f"{method} {key(pt)}", method, {**base, **pt, **user}, s)
            for pt in points if key(pt) not in done for s in seeds]
    for job, r in zip(jobs, run_all(jobs, args.jobs, args.cache), strict=True):
        done.setdefault(job.label.split(" ", 1)[1], []).append(r["loss"])


def best(losses: dict[str, list[float]], candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """The candidate with the lowest mean loss (the first of equals)."""
    return min(candidates, key=lambda pt: statistics.mean(losses[key(pt)]))


def tune_method(args: argparse.Namespace, base: dict[str, Any], method: str, seeds: list[int],
                losses: dict[str, list[float]]) -> dict[str, Any]:
    """Stage 1: the inner lr grid at the method's default outer lr; stage 2: its outer lr
    grid at the best inner lr. Returns the chosen point."""
    stage1 = [{"inner.lr": lr} for lr in floats(args.inner_lrs)]
    if method in OUTER_LRS:
        default = load_config(overrides={"compression.method": method}).outer.lr
        stage1 = [{**pt, "outer.lr": default} for pt in stage1]
    print(f"{method} stage 1: inner lr {args.inner_lrs}", flush=True)
    tune_points(args, base, method, stage1, seeds, losses)
    chosen = best(losses, stage1)
    if method not in OUTER_LRS:
        return chosen
    stage2 = [{**chosen, "outer.lr": lr} for lr in floats(getattr(args, f"{method}_outer_lrs"))]
    print(f"{method} stage 2: outer lr {getattr(args, f'{method}_outer_lrs')} at inner lr {chosen['inner.lr']}",
          flush=True)
    tune_points(args, base, method, stage2, seeds, losses)
    return best(losses, stage1 + stage2)


def tune(args: argparse.Namespace) -> dict[str, Any]:
    """Every method in TUNE_ORDER, one after the other; the settings file is written after
    each, so the evaluation of a tuned method can start while the next is tuned."""
    seeds = [int(s) for s in args.tune_seeds.split(",")]
    rounds = args.tune_rounds or args.rounds
    base = base_overrides(args, rounds)
    print(f"tuning on seeds {seeds}, {rounds} rounds", flush=True)
    regime = tuning_regime(args, rounds, seeds, base)
    losses = {} if args.tune_fresh else earlier_losses(args.tuned, regime)
    for method, points in losses.items():
        print(f"{method}: {len(points)} grid points from {args.tuned} (same regime; --tune-fresh trains them again)",
              flush=True)
    chosen: dict[str, dict[str, Any]] = {}
    for method in TUNE_ORDER:
        losses.setdefault(method, {})
        chosen[method] = tune_method(args, base, method, seeds, losses[method])
        report = tuning_report(regime, chosen, losses)
        write_tuned(args.tuned, {**report, **provenance(run_config(Job("", method, base, seeds[0])).task)})
    return report


def tuning_regime(args: argparse.Namespace, rounds: int, seeds: list[int], base: dict[str, Any]) -> dict[str, Any]:
    """What a tuning point's loss depends on beside the point itself: the run's size, the
    seeds, the users' overrides and the token stream (its fingerprint)."""
    cfg = run_config(Job("", "sparseloco", base, seeds[0]))
    return {"rounds": rounds, "seeds": seeds, "workers": args.workers, "inner_steps": args.inner_steps,
            "warmup_steps": base["inner.warmup_steps"], "model": args.model,
            "batch": [args.batch_size, args.seq_len], "partitioning": args.partitioning,
            "val_windows": args.val_windows,
            "user_overrides": {m: getattr(args, f"{m}_set") for m in METHODS},
            "data_fingerprint": provenance(cfg.task)["data_fingerprint"]}


# what a tuned file written before these fields were recorded was tuned with
REGIME_DEFAULTS = {"model": "gpt-tiny", "batch": [8, 32], "partitioning": "iid", "val_windows": 1024}


def earlier_losses(path: str, regime: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """The grid points' losses of an earlier tuning in ``path`` of the same ``regime`` (a
    tuning cut off, or one method's grid added later, goes on from there); {} where the
    file is not there or was tuned otherwise."""
    if not Path(path).exists():
        return {}
    earlier = json.loads(Path(path).read_text())
    if any(earlier.get(k, REGIME_DEFAULTS.get(k)) != v for k, v in regime.items()):
        return {}
    return earlier.get("losses", {})


def tuning_report(regime: dict[str, Any], chosen: dict[str, dict[str, Any]],
                  losses: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    return {"tuned": chosen, "losses": losses,
            "mean_losses": {m: {k: statistics.mean(v) for k, v in ls.items()} for m, ls in losses.items()},
            "search": "two-stage: inner lr at the default outer lr, then outer lr at the best inner lr",
            **regime}


def write_tuned(path: str, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(rounded(report), indent=1, sort_keys=True) + "\n")
    print(f"wrote {path} ({', '.join(report['tuned'])})", flush=True)


def print_tuning(report: dict[str, Any]) -> None:
    for m in report["tuned"]:
        print(f"{m}:")
        for point, mean in sorted(report["mean_losses"][m].items(), key=lambda kv: kv[1]):
            mark = "  <- chosen" if point == key(report["tuned"][m]) else ""
            print(f"  {point:<34} {' '.join(f'{x:.4f}' for x in report['losses'][m][point])}  mean {mean:.4f}{mark}")


# the evaluation stage -------------------------------------------------------------------------

def arm_names(spec: str) -> list[str]:
    names = {"primary": list(PRIMARY), "all": list(ARMS)}.get(spec) or spec.split(",")
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise ValueError(f"--arms: {unknown[0]!r} is not primary, all or one of {', '.join(ARMS)}")
    return names


def evaluation_jobs(args: argparse.Namespace, tuned: dict[str, dict[str, Any]]) -> list[Job]:
    """DiLoCo and AdamW at the tuned settings, each SparseLoCo arm at the defaults plus its
    own settings (sparseloco-tuned: SparseLoCo's tuned ones), user overrides last."""
    base = base_overrides(args, args.rounds)
    user = {m: pairs(getattr(args, f"{m}_set")) for m in METHODS}
    per_label = {"diloco": ("diloco", {**tuned.get("diloco", {}), **user["diloco"]}),
                 "adamw": ("adamw", {**tuned.get("adamw", {}), **user["adamw"]})}
    for arm in arm_names(args.arms):
        own = tuned.get("sparseloco", {}) if arm == "sparseloco-tuned" else ARMS[arm]
        per_label[arm] = ("sparseloco", {**user["sparseloco"], **own})
    return [Job(label, method, {**base, **over}, seed)
            for seed in range(args.seeds) for label, (method, over) in per_label.items()]


def summarize(jobs: list[Job], results: list[dict[str, Any]], bf16: int) -> dict[str, Any]:
    """Per label: losses by seed, mean, sd, upload; per SparseLoCo arm the paired ratios."""
    out: dict[str, Any] = {}
    for job, r in zip(jobs, results, strict=True):
        row = out.setdefault(job.label, {"method": job.method, "loss": [], "upload": []})
        row["loss"].append(r["loss"])
        row["upload"].append(r["upload"])
    for label, row in out.items():
        row["loss_mean"] = statistics.mean(row["loss"])
        row["loss_sd"] = statistics.stdev(row["loss"]) if len(row["loss"]) > 1 else 0.0
        upload = row.pop("upload")
        row["upload_bytes_per_worker_round"] = None if row["method"] == "adamw" else statistics.mean(upload)
        row["settings"] = settings(run_config(next(j for j in jobs if j.label == label)), row["method"])
        if row["method"] == "sparseloco":
            ratios = [a / b for a, b in zip(row["loss"], out["diloco"]["loss"], strict=True)]
            row.update(ratios=ratios, ratio_mean=statistics.mean(ratios), ratio_upper95=upper95(ratios),
                       gap_to_adamw=row["loss_mean"] - out["adamw"]["loss_mean"],
                       upload_vs_dense_bf16=row["upload_bytes_per_worker_round"] / bf16)
    return out


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_evaluation(args: argparse.Namespace, rows: dict[str, Any], bf16: int) -> None:
    labels = list(rows)
    print(f"model {args.model}, {args.workers} workers, {args.rounds} rounds of H={args.inner_steps}, batch "
          f"{args.batch_size}x{args.seq_len}, loss = mean validation loss of the last {VAL_TAIL} rounds")
    print(f"{'seed':<6}" + "".join(f"{label[:26]:>27}" for label in labels))
    for s in range(args.seeds):
        print(f"{s:<6}" + "".join(f"{rows[label]['loss'][s]:>27.4f}" for label in labels))
    print(f"{'mean':<6}" + "".join(f"{rows[label]['loss_mean']:>27.4f}" for label in labels))
    print(f"{'sd':<6}" + "".join(f"{rows[label]['loss_sd']:>27.4f}" for label in labels))
    print(f"dense bf16 upload: {bf16:,} B per worker and round")
    for label, row in rows.items():
        print(f"{label}: {json.dumps(row['settings'])}")
        if row["method"] != "sparseloco":
            continue
        share = row["upload_vs_dense_bf16"]
        print(f"  ratios vs DiLoCo {' '.join(f'{x:.4f}' for x in row['ratios'])}; mean {row['ratio_mean']:.4f} "
              f"(<= {TARGET_MEAN}: {verdict(row['ratio_mean'] <= TARGET_MEAN)}), upper95 "
              f"{row['ratio_upper95']:.4f} (<= {TARGET_UPPER}: {verdict(row['ratio_upper95'] <= TARGET_UPPER)}); "
              f"gap to AdamW {row['gap_to_adamw']:+.4f}; upload {row['upload_bytes_per_worker_round']:,.0f} B = "
              f"{100 * share:.2f} % of dense bf16 (<= 3 %: {verdict(share <= TARGET_UPLOAD)})")


def rounded(value: Any) -> Any:
    """``value`` with every float to 5 significant digits (None if not finite)."""
    if isinstance(value, float):
        return float(f"{value:.5g}") if math.isfinite(value) else None
    if isinstance(value, list):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    tuned = load_tuned(args.tuned)
    jobs = evaluation_jobs(args, tuned)
    if args.only:
        keep = args.only.split(",")
        jobs = [j for j in jobs if j.label in keep]
        results = run_all(jobs, args.jobs, args.cache)
        return {"only": keep, "loss": {label: [round(r["loss"], 4) for j, r in zip(jobs, results, strict=True)
                                                if j.label == label] for label in keep}}
    first = run_config(jobs[0])
    bf16 = dense_bf16_bytes(first)
    print(f"{len(jobs)} runs, {args.jobs} at a time; tuned settings from "
          f"{args.tuned if tuned else 'nowhere (defaults)'}", flush=True)
    rows = summarize(jobs, run_all(jobs, args.jobs, args.cache), bf16)
    print_evaluation(args, rows, bf16)
    arms = {label: {k: row[k] for k in ("ratios", "ratio_mean", "ratio_upper95", "loss", "loss_mean", "loss_sd",
                                         "gap_to_adamw", "upload_bytes_per_worker_round", "upload_vs_dense_bf16",
                                         "settings")}
            for label, row in rows.items() if row["method"] == "sparseloco"}
    primary = arms.get("sparseloco") or next(iter(arms.values()))
    return rounded({
        "arms": arms, "ratio_mean": primary["ratio_mean"], "ratio_upper95": primary["ratio_upper95"],
        "rounds": args.rounds, "seeds": list(range(args.seeds)), "workers": args.workers,
        "partitioning": args.partitioning, "model": args.model, "batch": [args.batch_size, args.seq_len],
        "inner_steps": args.inner_steps, "warmup_steps": first.inner.warmup_steps,
        "val_tail": VAL_TAIL, "dense_bf16_bytes": bf16,
        "diloco": {k: rows["diloco"][k] for k in ("loss", "loss_mean", "loss_sd", "upload_bytes_per_worker_round", "settings")},
        "adamw": {k: rows["adamw"][k] for k in ("loss", "loss_mean", "loss_sd", "settings")},
        "tuned_file": args.tuned if tuned else None,
        "user_overrides": {m: getattr(args, f"{m}_set") for m in METHODS},
    })


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    report = tune(args) if args.tune else evaluate(args)
    if args.tune:
        print_tuning(report)
    cfg = run_config(Job("", "sparseloco", base_overrides(args, args.rounds), 0))
    report = rounded({**report, **provenance(cfg.task), "wall_s": time.monotonic() - start, "jobs": args.jobs})
    if args.tune:
        write_tuned(args.tuned, report)
    print(f"{time.monotonic() - start:.0f} s")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
