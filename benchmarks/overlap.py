"""Overlapped rounds (outer.overlap none | delayed | eager) side by side in one run: real
processes through ``run_local`` (as benchmarks/wan.py), 4 workers, H = 15, in two regimes:
communication at about 50 % of the inner compute, and at about 150 % (the links set from a
calibration run on this machine, or given with --links). Utilization is the
mean over workers of inner-compute seconds over round seconds (metrics.jsonl), summed over
the steady rounds before dividing (``utilization``); the limit of
a round is max(compute, communication) + encode. The loss at equal tokens comes from the
in-process protocol (benchmarks/inprocess.py, simulate_overlap) in the parity benchmark's
regime (8 workers, batch 8 x 32, iid partitions, 1,024 validation windows, warm-up 15 % of
the inner steps, the mean of the last 5 rounds' validation losses) and SparseLoCo's tuned
settings (benchmarks/parity_tuned.json) over several seeds, paired by seed against
``none``. Prints a table, then one JSON line (docs/benchmarks.md).

    python -m benchmarks.overlap            # 4 workers, H=15, 20 rounds; loss: 5 seeds x 40 rounds
    python -m benchmarks.overlap --loss-only --seeds 3                 # the loss part alone
    python -m benchmarks.overlap --time-only                           # the real-process part alone
    python -m benchmarks.overlap --loss-only --set outer.lr=0.5        # ... at another outer lr
    python -m benchmarks.overlap --loss-only --set outer.fold_step=7   # ... folding mid-phase
    python -m benchmarks.overlap --fold-step arrival   # overlapped arms fold as soon as the result is in
    python -m benchmarks.overlap --fold-steps 1,3,7,15                 # eager's loss against its fold step
    python -m benchmarks.overlap --quick    # one regime, 2 workers, H=2, 3 rounds, 1 seed: a smoke test

``--fold-step`` sets outer.fold_step in the real runs' overlapped arms; the JSON line then
gives where their phases folded (``mean_fold_step``, H for a fold at the end) and the loss
runs fold at K, or for "arrival" at the first regime's mean step (``loss_fold_step``).
``--fold-steps`` is the trade-off a user picks outer.fold_step by: eager's loss (paired
against ``none``) when the late result is folded in before inner step k (k = H: at the
phase's end), beside the share of the phase's compute that can hide the transfer without a
wait (k / H). It runs the loss part alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.inprocess import VAL_TAIL, simulate_overlap
from benchmarks.parity import TUNED_FILE, load_tuned, pairs
from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config
from geoloco.launch import run_local
from geoloco.profiles import LinkProfile

MODES = ("none", "delayed", "eager")
# Each regime's communication (a worker's bytes per round over its link, plus one round
# trip) over the inner compute of a round. The links are set from a calibration run of
# `none` on a fast link (regime_links), since a fixed rate is another regime on every
# machine: 4 Mbit/s was about 50 % of gpt-tiny's compute under load, 80-86 % on the idle VM.
REGIMES = {"comm50": 0.5, "comm150": 1.5}
CALIBRATION_LINK = "1gbit/50ms"
MAX_DELAY_S = 0.05  # the links' one-way delay, at most a quarter of the regime's transfer time
QUICK_LOSS = {"loss_rounds": 2, "seeds": 1, "loss_batch_size": 2, "val_windows": 16}
QUICK = {"workers": 2, "rounds": 3, "warmup_rounds": 1, "inner_steps": 2, "seq_len": 16,
         "regimes": {"comm50": "20mbit/10ms"}, "loss_workers": 2, **QUICK_LOSS}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--inner-steps", type=int, default=15, help="H, in the papers' range")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20, help="rounds of each real-process run")
    p.add_argument("--warmup-rounds", type=int, default=2, help="first rounds left out of the means")
    p.add_argument("--loss-workers", type=int, default=8, help="workers of the loss runs (parity's)")
    add_loss_args(p)
    p.add_argument("--run-dir", default="runs/bench-overlap")
    p.add_argument("--quick", action="store_true", help="tiny runs: checks the plumbing only")
    p.add_argument("--loss-only", action="store_true", help="only the in-process loss at equal tokens")
    p.add_argument("--time-only", action="store_true", help="only the real-process runs (no loss runs)")
    p.add_argument("--run-set", dest="run_overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every real-process run, e.g. worker.state_every=0")
    p.add_argument("--links", default=None, metavar="LINK,LINK",
                   help="the two regimes' links (e.g. 4mbit/50ms,1mbit/50ms); default: set from a calibration run")
    p.add_argument("--fold-step", default=None, metavar="K|arrival",
                   help="outer.fold_step of the real-process runs' overlapped arms (default: at the phase's end)")
    p.add_argument("--fold-steps", type=fold_steps, default=None, metavar="K,K,...",
                   help="eager's loss at each outer.fold_step k (H: at the phase's end) against none; loss only")
    args = p.parse_args(argv)
    if args.time_only and (args.loss_only or args.fold_steps is not None):
        p.error("--time-only runs no loss: it goes with neither --loss-only nor --fold-steps")
    if args.fold_steps is not None:
        args.loss_only = True
    if args.links is not None and len(args.links.split(",")) != len(REGIMES):
        p.error(f"--links: one link per regime ({', '.join(REGIMES)}), comma-separated")
    links = [x.strip() for x in args.links.split(",")] if args.links else [None] * len(REGIMES)
    args.regimes = {} if args.loss_only else dict(zip(REGIMES, links, strict=True))
    read_loss_args(p, args)
    try:
        args.run_overrides = pairs(args.run_overrides)
    except ValueError as e:
        p.error(f"--run-set: {e}")
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        if args.loss_only:
            args.regimes = {}
    if args.fold_steps is not None and any(k > args.inner_steps for k in args.fold_steps):
        p.error(f"--fold-steps: each k is an inner step, 1..{args.inner_steps} (H: at the phase's end)")
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    return args


def fold_steps(text: str) -> list[int]:
    """--fold-steps' value: inner steps, comma-separated, each at least 1."""
    try:
        steps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of inner steps") from None
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give inner steps of at least 1")
    return steps


def config(args: argparse.Namespace, mode: str, wan: str, run_dir: str, rounds: int, seed: int = 0,
           **extra: Any) -> RunConfig:
    """One task for every arm; only the overlap mode (with --fold-step), the link and the seed differ."""
    if mode != "none" and getattr(args, "fold_step", None) is not None:
        extra = {"outer.fold_step": args.fold_step, **extra}
    extra = {**getattr(args, "run_overrides", {}), **extra}
    return load_config(overrides={
        "workers": args.workers, "rounds": rounds, "seed": seed, "run_dir": run_dir,
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_windows": 16, "inner.steps": args.inner_steps, "inner.warmup_steps": 0,
        "outer.overlap": mode, "network.wan": wan, "coordinator.deadline_s": 3600.0,
        "coordinator.checkpoint_every": 0, "coordinator.val_every": 0, **extra,
    })


def measure(cfg: RunConfig, warmup: int) -> dict[str, Any]:
    """One run through the local launcher: the steady rounds' means from metrics.jsonl."""
    if not run_local(cfg, overwrite=True).ok:  # this benchmark's own run dirs, from a run before
        raise SystemExit(f"the run in {cfg.run_dir} failed; see its logs")
    lines = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines() if x]
    steady = lines[warmup:]
    return {
        "round_s": statistics.mean(m["round_seconds"] for m in steady),
        "utilization": utilization(steady),
        "utilization_per_round": statistics.mean(min(1.0, m["compute_seconds"] / m["round_seconds"]) for m in steady),
        "compute_s": statistics.mean(m["compute_seconds"] for m in steady),
        "encode_s": statistics.mean(m["encode_seconds_max"] for m in steady),
        "up_bytes": statistics.mean(m["upload_bytes_per_worker"] for m in steady),
        "down_bytes": statistics.mean(m["download_bytes_per_worker"] for m in steady),
        "digest_mismatches": json.loads((Path(cfg.run_dir) / "summary.json").read_text())["digest_mismatches"],
        **fold_summary(cfg, logged_fold_steps(Path(cfg.run_dir))),
    }


FOLDED = re.compile(r"round \d+'s result folded in before inner step (\d+) of round (\d+)")


def logged_fold_steps(run_dir: Path) -> dict[tuple[int, int], int]:
    """(worker id, round) -> the inner step before which that phase folded the late result
    in, from the workers' logs (geoloco.worker.loop.Worker.fold_mid_phase); a phase that
    folded at its end is not in it."""
    steps = {}
    for path in sorted((run_dir / "logs").glob("worker-*.log")):
        text = path.read_text()
        joined = re.search(r"joined as worker (\d+)", text)
        if joined is None:
            continue
        for m in FOLDED.finditer(text):
            steps[(int(joined.group(1)), int(m.group(2)))] = int(m.group(1))
    return steps


def fold_summary(cfg: RunConfig, steps: dict[tuple[int, int], int]) -> dict[str, Any]:
    """Where the overlapped phases folded: the share folded mid-way and their mean step
    (a phase folded at its end counts as H)."""
    if cfg.outer.overlap == "none":
        return {}
    phases = cfg.workers * (cfg.rounds - 1)
    at = list(steps.values()) + [cfg.inner.steps] * max(0, phases - len(steps))
    return {"folded_mid_phase": round(len(steps) / phases, 3), "mean_fold_step": round(statistics.mean(at), 2)}


def regime_links(args: argparse.Namespace) -> dict[str, str]:
    """Each regime's link, from a calibration run of ``none`` on a fast link: the rate at
    which the bytes a worker moves a round, plus one round trip, take the regime's share of
    its inner compute (REGIMES)."""
    cfg = config(args, "none", CALIBRATION_LINK, f"{args.run_dir}/calibration", args.warmup_rounds + 6)
    m = measure(cfg, args.warmup_rounds)
    links = {}
    for regime, ratio in REGIMES.items():
        target = ratio * m["compute_s"]
        delay = min(MAX_DELAY_S, target / 8)
        rate = (m["up_bytes"] + m["down_bytes"]) * 8.0 / (target - 2 * delay)
        links[regime] = str(LinkProfile(rate_bps=round(rate, -3), delay_s=delay))
    print(f"calibration: inner compute {m['compute_s']:.3f}s, {m['up_bytes'] + m['down_bytes']:,.0f} bytes a "
          f"worker a round; links {links}", file=sys.stderr, flush=True)
    return links


def utilization(rounds: list[dict[str, Any]]) -> float:
    """The share of the steady rounds' time the workers spent in inner compute: the workers'
    mean compute seconds summed over the rounds, over the rounds' seconds summed. Not a mean
    of per-round ratios capped at 1: under overlap a round's frame was trained while the
    round before it was open, so one round's compute may exceed its own length and the next
    round's fall short of it, and capping the first while counting the second whole biases
    the mean down by the rounds' jitter."""
    return sum(m["compute_seconds"] for m in rounds) / sum(m["round_seconds"] for m in rounds)


def communication_s(m: dict[str, Any], link: LinkProfile) -> float:
    """Bytes up and down over the link's rate plus one round trip."""
    return (m["up_bytes"] + m["down_bytes"]) * 8.0 / link.rate_bps + link.rtt_s


def paired(losses: dict[str, list[float]], mode: str) -> dict[str, float]:
    """``mode``'s final loss relative to ``none``'s, paired by seed: the mean and the 95 %
    upper bound (Student t) of (mode - none) / none."""
    rel = [(a - b) / b for a, b in zip(losses[mode], losses["none"], strict=True)]
    mean = statistics.mean(rel)
    if len(rel) < 2:
        return {"mean": round(mean, 5), "upper95": None}
    upper = mean + T95.get(len(rel) - 1, 1.96) * statistics.stdev(rel) / math.sqrt(len(rel))
    return {"mean": round(mean, 5), "upper95": round(upper, 5)}


def add_loss_args(p: argparse.ArgumentParser) -> None:
    """The in-process loss runs' options (here and in benchmarks/heterogeneous.py): the
    parity benchmark's regime and SparseLoCo's tuned settings by default."""
    p.add_argument("--loss-rounds", type=int, default=40, help="rounds of each in-process loss run")
    p.add_argument("--loss-batch-size", type=int, default=8, help="batch of the loss runs (parity's)")
    p.add_argument("--val-windows", type=int, default=1024, help="validation windows of the loss runs")
    p.add_argument("--warmup", type=float, default=0.15, help="loss runs' warm-up, a share of the inner steps")
    p.add_argument("--seeds", type=int, default=5, help="in-process loss runs per arm")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the loss runs' seeds start here (tuning: keep them apart from the evaluation's 0..)")
    p.add_argument("--jobs", type=int, default=2, help="loss runs at once")
    p.add_argument("--tuned", default=str(TUNED_FILE),
                   help="the parity benchmark's tuned settings, SparseLoCo's taken for the loss runs ('none': defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every loss run (every arm alike, after --tuned), e.g. outer.lr=0.5")


def read_loss_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """args.overrides: SparseLoCo's tuned settings, then --set's."""
    try:
        args.overrides = {**load_tuned(args.tuned).get("sparseloco", {}), **pairs(args.overrides)}
    except ValueError as e:
        p.error(f"--set: {e}")


def loss_overrides(args: argparse.Namespace, workers: int, seed: int) -> dict[str, Any]:
    """A loss run's config: the parity benchmark's regime (benchmarks/parity.py) at
    ``workers``, SparseLoCo at its tuned settings and --set's overrides."""
    return {
        "workers": workers, "rounds": args.loss_rounds, "seed": seed,
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.loss_batch_size,
        "task.val_windows": args.val_windows, "task.partitioning": "iid", "inner.steps": args.inner_steps,
        "inner.warmup_steps": round(args.warmup * args.loss_rounds * args.inner_steps),
        "compression.method": "sparseloco", **args.overrides,
    }


def loss_seeds(args: argparse.Namespace) -> range:
    return range(args.first_seed, args.first_seed + args.seeds)


def loss_regime(args: argparse.Namespace, workers: int) -> dict[str, Any]:
    """What the loss runs were, for the JSON line."""
    return {"workers": workers, "rounds": args.loss_rounds, "seeds": list(loss_seeds(args)),
            "batch": [args.loss_batch_size, args.seq_len],
            "val_windows": args.val_windows, "warmup": args.warmup, "inner_steps": args.inner_steps,
            "overrides": args.overrides}


def loss_of(job: tuple[RunConfig, list[float] | None]) -> float:
    """One loss run (a config, and each worker's density or None): the mean of its last
    VAL_TAIL rounds' validation losses."""
    cfg, densities = job
    return simulate_overlap(cfg, densities=densities, val_tail=VAL_TAIL).tail_val_loss()


def run_losses(jobs: list[tuple[RunConfig, list[float] | None]], n_jobs: int,
               labels: list[str] | None = None) -> list[float]:
    """loss_of for every job, n_jobs at once, in the jobs' order; each loss on stderr as it
    comes (``labels``: what to call each job)."""
    losses: list[float] = []
    with ProcessPoolExecutor(max_workers=n_jobs) as pool:
        for i, loss in enumerate(pool.map(loss_of, jobs)):
            losses.append(loss)
            label = labels[i] if labels else f"run {i + 1}"
            print(f"loss {label} ({i + 1}/{len(jobs)}): {loss:.4f}", file=sys.stderr, flush=True)
    return losses


def loss_config(args: argparse.Namespace, mode: str, seed: int, fold_step: Any = "--set") -> RunConfig:
    """A loss run of ``mode``; an outer.fold_step of --set is the overlapped arms' alone,
    unless ``fold_step`` gives one (None: at the phase's end)."""
    overrides = {**loss_overrides(args, args.loss_workers, seed), "outer.overlap": mode}
    if fold_step != "--set":
        overrides["outer.fold_step"] = fold_step
    if mode == "none" or overrides.get("outer.fold_step") is None:
        overrides.pop("outer.fold_step", None)
    return load_config(overrides=overrides)


def losses_in_process(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each mode's loss at equal tokens, per seed, --jobs runs at once."""
    jobs = [(mode, seed) for seed in loss_seeds(args) for mode in MODES]
    losses = run_losses([(loss_config(args, mode, seed), None) for mode, seed in jobs], args.jobs,
                        [f"{mode} seed {seed}" for mode, seed in jobs])
    out: dict[str, list[float]] = {mode: [] for mode in MODES}
    for (mode, _), loss in zip(jobs, losses, strict=True):
        out[mode].append(loss)
    return out


def loss_fold_step(args: argparse.Namespace, runs: dict[str, dict[str, dict[str, Any]]]) -> int | None:
    """The fold step of the loss runs' overlapped arms under --fold-step (unless --set gives
    one): K itself; for "arrival", the step eager's phases folded at on average in the first
    regime's real run (the loss runs have no clock to fold by). Sets it in args.overrides."""
    if args.fold_step is None or "outer.fold_step" in args.overrides:
        return args.overrides.get("outer.fold_step")
    step = args.fold_step
    if str(step).lower() == "arrival":
        first = next(iter(runs.values()), {})
        if "mean_fold_step" not in first.get("eager", {}):
            return None
        step = round(first["eager"]["mean_fold_step"])
        print(f"loss runs fold before inner step {step}: where eager's phases folded on average in "
              f"{next(iter(runs))}'s real run", file=sys.stderr)
    step = int(step)
    if step < args.inner_steps:
        args.overrides["outer.fold_step"] = step
        return step
    return None


def fold_sweep(args: argparse.Namespace) -> int:
    """--fold-steps: ``none`` and eager at each fold step k, per seed, paired by seed."""
    arms = {"none": None, **{f"eager@{k}": k for k in args.fold_steps}}
    jobs = [(arm, seed) for seed in loss_seeds(args) for arm in arms]
    configs = [(loss_config(args, "none" if arm == "none" else "eager", seed,
                            arms[arm] if arms[arm] is not None and arms[arm] < args.inner_steps else None), None)
               for arm, seed in jobs]
    losses: dict[str, list[float]] = {arm: [] for arm in arms}
    for (arm, _), loss in zip(jobs, run_losses(configs, args.jobs, [f"{a} seed {s}" for a, s in jobs]), strict=True):
        losses[arm].append(loss)
    rows = {arm: {"fold_step": k, "hidden_share": round(k / args.inner_steps, 3) if k else 0.0,
                  "final_loss": [round(x, 4) for x in losses[arm]],
                  "vs_none": paired(losses, arm) if arm != "none" else None} for arm, k in arms.items()}
    print(f"{'arm':<11}{'fold before step':>17}{'hides up to':>13}{'mean loss':>11}{'vs none':>10}{'upper 95 %':>12}")
    for arm, row in rows.items():
        vs = row["vs_none"] or {}
        upper = vs.get("upper95")
        print(f"{arm:<11}{row['fold_step'] or '-':>17}{row['hidden_share']:>12.0%} {statistics.mean(losses[arm]):>11.4f}"
              f"{vs.get('mean', 0.0):>+10.2%}{'' if upper is None else format(upper, '+.2%'):>12}")
    print(f"H={args.inner_steps}: a fold before step k waits unless the transfer takes under k / H of the phase's "
          f"compute; {args.seeds} seeds from {args.first_seed}, {args.loss_rounds} rounds, {args.loss_workers} workers")
    print(json.dumps({"fold_steps": rows, "loss_regime": loss_regime(args, args.loss_workers),
                      **provenance(loss_config(args, "none", args.first_seed).task)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.fold_steps is not None:
        return fold_sweep(args)
    load = [os.getloadavg()[0]]
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    if args.regimes and None in args.regimes.values():
        args.regimes = regime_links(args)
    for regime, wan in args.regimes.items():
        link = LinkProfile.parse(wan)
        for mode in MODES:
            cfg = config(args, mode, wan, f"{args.run_dir}/{regime}-{mode}", args.rounds)
            m = measure(cfg, args.warmup_rounds)
            m["communication_s"] = communication_s(m, link)
            m["limit_s"] = max(m["compute_s"], m["communication_s"]) + m["encode_s"]
            runs.setdefault(regime, {})[mode] = m
            load.append(os.getloadavg()[0])
    loss_fold = None if args.time_only else loss_fold_step(args, runs)
    losses = {} if args.time_only else losses_in_process(args)
    result: dict[str, Any] = {} if args.time_only else {"loss_fold_step": loss_fold}
    for regime, by_mode in runs.items():
        comm_over_compute = by_mode["none"]["communication_s"] / by_mode["none"]["compute_s"]
        result[regime] = {"comm_over_compute": round(comm_over_compute, 2), "link": args.regimes[regime]}
        for mode, m in by_mode.items():
            result[regime][mode] = {
                "utilization": round(m["utilization"], 3), "round_s": round(m["round_s"], 3),
                "utilization_per_round": round(m["utilization_per_round"], 3),
                "limit_s": round(m["limit_s"], 3), "communication_s": round(m["communication_s"], 3),
                "round_over_limit": round(m["round_s"] / m["limit_s"], 3),
                "round_over_communication": round(m["round_s"] / m["communication_s"], 3),
                "digest_mismatches": m["digest_mismatches"],
                **{k: m[k] for k in ("folded_mid_phase", "mean_fold_step") if k in m},
            }
            if losses:
                result[regime][mode]["final_loss"] = {
                    "mean": round(statistics.mean(losses[mode]), 4),
                    "sd": round(statistics.stdev(losses[mode]), 4) if len(losses[mode]) > 1 else 0.0}
    if losses:
        result["final_loss"] = {mode: [round(x, 4) for x in values] for mode, values in losses.items()}
        result["loss_vs_none"] = {mode: paired(losses, mode) for mode in MODES[1:]}
        result["loss_seeds"], result["loss_rounds"] = args.seeds, args.loss_rounds
        result["loss_regime"] = loss_regime(args, args.loss_workers)
    result["load_average"] = [round(min(load), 2), round(max(load), 2)]
    print(table(runs, losses))
    loss_runs = "no loss runs (--time-only)" if args.time_only else (
        f"loss: {args.seeds} seeds x {args.loss_rounds} rounds in-process, {args.loss_workers} workers, batch "
        f"{args.loss_batch_size}x{args.seq_len}, mean of the last {VAL_TAIL} rounds' validation losses "
        f"(overrides {args.overrides or 'none'})")
    print(f"model {args.model}, H={args.inner_steps}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.workers} workers, {args.rounds} rounds ({args.warmup_rounds} warm-up) per run"
          f"{', outer.fold_step ' + str(args.fold_step) if args.fold_step is not None else ''}; {loss_runs}; "
          f"load average {min(load):.1f}-{max(load):.1f}")
    print(json.dumps({**result, **provenance(loss_config(args, "none", 0).task)}))
    return 0


def table(runs: dict[str, dict[str, dict[str, Any]]], losses: dict[str, list[float]]) -> str:
    lines = [f"{'regime':<9}{'mode':<9}{'util':>7}{'util/rd':>8}{'round s':>9}{'limit s':>9}{'comm s':>8}"
             f"{'compute s':>10}{'fold k':>8}{'final loss':>12}"]
    for regime, by_mode in runs.items():
        for mode, m in by_mode.items():
            lines.append(f"{regime:<9}{mode:<9}{m['utilization']:>7.3f}{m['utilization_per_round']:>8.3f}{m['round_s']:>9.3f}"
                         f"{m['limit_s']:>9.3f}{m['communication_s']:>8.3f}{m['compute_s']:>10.3f}"
                         f"{m.get('mean_fold_step', float('nan')):>8.2f}"
                         f"{statistics.mean(losses[mode]) if losses else float('nan'):>12.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
