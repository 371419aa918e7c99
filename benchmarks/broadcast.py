"""The aggregated round result against the workers' frames (issue 25; docs/decisions.md,
"One frame down"): ``coordinator.broadcast`` ``aggregate`` sends one frame the coordinator
compresses, with its own error feedback, where ``frames`` sends the n workers' frames
(SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706). Two questions, a table each:

1. Loss at equal tokens. ``frames`` and ``aggregate`` on the same seeds through the round
   protocol in one process (``benchmarks.inprocess.simulate``; coding.scheme ``none``), at
   n = 8, 16 and 32, seeds 0-4: per n the paired ratios aggregate / frames, their mean and
   one-sided 95 % upper bound (target: mean <= 1.01), the broadcast density, and the bytes
   a worker downloads per round in each mode. The parity benchmark's regime: gpt-tiny, iid
   partitions, 1,024 validation windows, H = 15, batch 8 x 32, warm-up 15 %, SparseLoCo at
   its defaults; a run's loss is the mean validation loss of its last 5 rounds. A
   ``frames`` download is the sum of the n workers' frames of the run itself (n x the mean
   upload); ``simulate`` does not record the coordinator's frame, so an ``aggregate``
   download is one coordinator frame measured here: n workers' frames of Gaussian deltas
   through the real ``make_outer``, on the model's layout (index coding is entropy coded,
   so a frame of real deltas may differ by a few per cent).
2. Round time against n, computed, no training: from the bytes of one worker frame and one
   aggregate frame of GPT-2's 124M layout (``benchmarks.scale.gpt2_layout``; measured as
   above), with a 1 Gbit/s coordinator uplink and 100 Mbit/s worker links, n = 4 .. 1024:
   per mode the download per worker and round, the coordinator's upload per round (n x
   that) and the round's communication time, max(worker upload, coordinator upload /
   uplink, worker download). The coordinator's ingress, n worker frames, is below its
   upload in both modes (an aggregate frame is larger than a worker's) and left out.

Rounds: 20 by default (300 inner steps per worker, 0.6 tokens per parameter at n = 8, as
parity's earlier 20-round runs). The cost is the 30 runs' worker-rounds, 2 x 5 x (8 + 16 +
32) x 20 = 11,200 of H = 15 steps at batch 8 x 32, plus 5 validations and start-up per run.
A worker-round took 1.5 s in this session (one process, the machine loaded by other jobs;
a run of n = 8, 2 rounds, ran 37 s alone and 182 s two at a time under the heaviest load;
a --quick run, 60 s, is all start-up and says nothing about this), and 0.5-0.7 s on the
idle 2-core VM (parity's and straggler_loss's recorded runs): about 50-70 minutes with
--jobs 2 on the idle VM, 2.5 hours or more under this session's load.

    python -m benchmarks.broadcast                    # both questions, 20 rounds of H = 15
    python -m benchmarks.broadcast --only round-time  # question 2 alone (a minute)
    python -m benchmarks.broadcast --quick            # n = 2, 4, 2 seeds, 3 rounds of H = 2: a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from typing import Any

import torch

from benchmarks.inprocess import close, simulate
from benchmarks.parity import rounded, upper95
from benchmarks.provenance import provenance
from benchmarks.scale import gpt2_layout, layout_for
from geoloco.compression import Layout, decode_frame
from geoloco.config import RunConfig, load_config
from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.outer import broadcast_density, broadcast_passes, make_outer
from geoloco.coordinator.rounds import Arrival, close_policy
from geoloco.replica import sparse_compressor
from geoloco.tasks import build_task

MODES = ("frames", "aggregate")
TARGET = 1.01  # mean aggregate / frames loss ratio
DEFAULT_NS = (8, 16, 32)
ROUND_TIME_NS = tuple(2**k for k in range(2, 11))  # 4 .. 1024
MEASURE_ROUNDS = 3  # rounds of synthetic frames a frame size is the mean of (the first has no error feedback)
QUICK = {"ns": "2,4", "seeds": 2, "rounds": 3, "inner_steps": 2, "seq_len": 16, "batch_size": 2,
         "val_windows": 8}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", default=",".join(map(str, DEFAULT_NS)), help="worker counts of question 1")
    p.add_argument("--seeds", type=int, default=5, help="seeds FIRST_SEED .. FIRST_SEED + SEEDS - 1")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inner-steps", type=int, default=15, help="H")
    p.add_argument("--warmup", type=float, default=0.15, help="warm-up, a fraction of all inner steps")
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per worker and inner step")
    p.add_argument("--val-windows", type=int, default=1024)
    p.add_argument("--layout", default="gpt2-124m", choices=("gpt2-124m", "model"),
                   help="question 2's layout: GPT-2 124M, or --model's (--quick: a 3M-parameter GPT-2)")
    p.add_argument("--coordinator-uplink-mbps", type=float, default=1000.0)
    p.add_argument("--worker-link-mbps", type=float, default=100.0, help="each worker's upload and download")
    p.add_argument("--broadcast-density", type=float, default=None,
                   help="coordinator.broadcast_density of the aggregate runs (default: the config's)")
    p.add_argument("--broadcast-passes", type=int, default=None,
                   help="coordinator.broadcast_passes of the aggregate runs: frames per round result")
    p.add_argument("--only", choices=("loss", "round-time"), default=None, help="one question (default both)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one core each)")
    p.add_argument("--quick", action="store_true", help="n = 2, 4, 2 seeds, 3 rounds of H = 2: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def run_config(args: argparse.Namespace, n: int, mode: str, seed: int = 0) -> RunConfig:
    """Question 1's run: the parity regime at ``n`` workers, broadcast ``mode``."""
    return load_config(overrides={
        "workers": n, "rounds": args.rounds, "seed": seed, "task.model": args.model,
        "task.seq_len": args.seq_len, "task.batch_size": args.batch_size, "task.val_windows": args.val_windows,
        "task.partitioning": "iid", "inner.steps": args.inner_steps,
        "inner.warmup_steps": round(args.warmup * args.rounds * args.inner_steps),
        "compression.method": "sparseloco", "coding.scheme": "none", "coordinator.broadcast": mode,
        "coordinator.broadcast_density": args.broadcast_density,
        "coordinator.broadcast_passes": args.broadcast_passes})


def run_one(cfg: RunConfig) -> dict[str, float]:
    """One training run: its loss (the mean of the last rounds'), mean upload per worker
    and round, wall time."""
    start = time.monotonic()
    result = simulate(cfg)
    return {"loss": result.tail_val_loss(), "upload": statistics.mean(result.upload_bytes),
            "seconds": time.monotonic() - start}


def seeds_of(args: argparse.Namespace) -> list[int]:
    return list(range(args.first_seed, args.first_seed + args.seeds))


def train_all(args: argparse.Namespace, ns: list[int]) -> dict[tuple[int, str, int], dict[str, float]]:
    """Every (n, mode, seed) run, ``args.jobs`` at a time, the largest n first; a line per
    finished run on stderr."""
    keys = [(n, mode, seed) for n in sorted(ns, reverse=True) for seed in seeds_of(args) for mode in MODES]
    start, out = time.monotonic(), {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        pending = {pool.submit(run_one, run_config(args, *key)): key for key in keys}
        for done, future in enumerate(as_completed(pending), 1):
            key = pending[future]
            out[key] = future.result()
            print(f"[{done}/{len(keys)}] n {key[0]} {key[1]} seed {key[2]}: loss {out[key]['loss']:.4f} "
                  f"({out[key]['seconds']:.0f} s; {time.monotonic() - start:.0f} s in all)",
                  file=sys.stderr, flush=True)
    return out


# frame sizes ---------------------------------------------------------------------------------

def frame_bytes(cfg: RunConfig, layout: Layout, n: int, rounds: int = MEASURE_ROUNDS) -> tuple[float, float]:
    """Bytes of one worker frame and of one aggregate frame on ``layout``: ``n`` workers
    compress Gaussian deltas with the run's codec (their own error feedback), the
    coordinator's outer optimizer (``make_outer``, coordinator.broadcast aggregate) closes
    each round on all of them; the means over ``rounds`` rounds. ``cfg``: an aggregate run's."""
    outer = make_outer(cfg, layout)
    workers = [sparse_compressor(layout, cfg.compression) for _ in range(n)]
    policy = close_policy(make_code("none", n, 0, 0), cfg.coding)
    decision = close(policy, list(range(n)))
    gen = torch.Generator().manual_seed(0)
    sent, broadcast = [], []
    for t in range(rounds):
        arrivals = []
        for i, worker in enumerate(workers):
            data = worker.compress([torch.randn(s.shape, generator=gen) * 1e-3 for s in layout.specs],
                                   round=t, sender=i)
            arrivals.append((Arrival(i, data, decode_frame(data, layout)), decision.coefficients[i]))
            sent.append(len(data))
        update = outer.step(t, arrivals, decision)
        broadcast.append(sum(len(f.data) for f in update.frames))
    return statistics.mean(sent), statistics.mean(broadcast)


def model_layout(cfg: RunConfig) -> Layout:
    model = build_task(cfg.task, cfg.workers, seed=cfg.seed).make_model()
    return Layout.from_named_tensors(model.named_parameters())


# question 1: loss at equal tokens ------------------------------------------------------------

def loss_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per n: losses per mode and seed, the paired ratios, density and downloads."""
    ns = [int(x) for x in args.ns.split(",")]
    runs = train_all(args, ns)
    rows = []
    for n in ns:
        cfg = run_config(args, n, "aggregate")
        frames = [runs[n, "frames", s] for s in seeds_of(args)]
        aggregate = [runs[n, "aggregate", s] for s in seeds_of(args)]
        ratios = [a["loss"] / f["loss"] for a, f in zip(aggregate, frames, strict=True)]
        upload = statistics.mean(r["upload"] for r in frames)
        worker_synthetic, coordinator = frame_bytes(cfg, model_layout(cfg), n)
        rows.append({"n": n, "loss_frames": [f["loss"] for f in frames], "loss_aggregate": [a["loss"] for a in aggregate],
                     "ratios": ratios, "ratio_mean": statistics.mean(ratios), "ratio_upper95": upper95(ratios),
                     "worker_density": cfg.compression.density, "broadcast_density": broadcast_density(cfg),
                     "broadcast_passes": broadcast_passes(cfg), "worker_frame_bytes": upload, "worker_frame_bytes_synthetic": worker_synthetic,
                     "download_frames_bytes": n * upload, "download_aggregate_bytes": coordinator})
    return rows


def print_loss(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(f"1. loss at equal tokens: {args.model}, {args.rounds} rounds of H={args.inner_steps}, batch "
          f"{args.batch_size}x{args.seq_len}, seeds {seeds_of(args)[0]}-{seeds_of(args)[-1]}; ratio = aggregate / frames "
          "of the same seed")
    print(f"{'n':>4}  {'ratios':<{8 * args.seeds}}{'mean':>8}{'upper95':>9}  {'<= 1.01':<8}{'density':>9}"
          f"{'bcast':>8}{'passes':>7}{'down frames B':>15}{'down aggr B':>13}{'aggr/frames':>12}")
    for r in rows:
        met = "met" if r["ratio_mean"] <= TARGET else "NOT met"
        print(f"{r['n']:>4}  {''.join(f'{x:<8.4f}' for x in r['ratios'])}{r['ratio_mean']:>8.4f}"
              f"{r['ratio_upper95']:>9.4f}  {met:<8}{r['worker_density']:>9.4f}{r['broadcast_density']:>8.4f}"
              f"{r['broadcast_passes']:>7}{r['download_frames_bytes']:>15,.0f}{r['download_aggregate_bytes']:>13,.0f}"
              f"{r['download_aggregate_bytes'] / r['download_frames_bytes']:>12.3f}")


# question 2: round time against n ------------------------------------------------------------

def round_time(args: argparse.Namespace) -> dict[str, Any]:
    """Question 2's table from one worker frame and the aggregate's frames of the layout at
    each n's broadcast density and passes (the default follows n: ``broadcast_density``).
    An aggregate's bytes are measured from two workers' frames: top-k keeps k a chunk and
    codes them in the same bits whatever the input, so they depend on the density, not on n."""
    cfg = run_config(args, 2, "aggregate")
    if args.layout == "model":
        layout = model_layout(cfg)
    else:
        layout = layout_for(True) if args.quick else gpt2_layout()
    up, link = args.coordinator_uplink_mbps * 1e6 / 8, args.worker_link_mbps * 1e6 / 8  # bytes/s
    rows, plans = [], {}
    for n in ROUND_TIME_NS:
        at_n = run_config(args, n, "aggregate")
        plan = (broadcast_density(at_n), broadcast_passes(at_n))
        if plan not in plans:
            plans[plan] = frame_bytes(replace(at_n, workers=2, coordinator=replace(
                at_n.coordinator, broadcast_density=plan[0], broadcast_passes=plan[1])), layout, 2)
        worker, aggregate = plans[plan]
        row: dict[str, Any] = {"n": n, "broadcast_density": plan[0], "broadcast_passes": plan[1]}
        for mode, down in (("frames", n * worker), ("aggregate", aggregate)):
            terms = {"worker upload": worker / link, "coordinator uplink": n * down / up, "worker download": down / link}
            bound = max(terms, key=terms.get)
            row[mode] = {"download_bytes": down, "coordinator_upload_bytes": n * down,
                         "round_comm_s": terms[bound], "bound_by": bound}
        rows.append(row)
    worker = statistics.mean(w for w, _ in plans.values())
    return {"layout_params": layout.numel, "worker_frame_bytes": worker,
            "aggregate_bytes_by_plan": [{"broadcast_density": d, "broadcast_passes": p, "bytes": b}
                                        for (d, p), (_, b) in plans.items()],
            "coordinator_uplink_mbps": args.coordinator_uplink_mbps, "worker_link_mbps": args.worker_link_mbps,
            "rows": rows, "uplink_bound_from": {m: uplink_bound_from(rows, m) for m in MODES}}


def uplink_bound_from(rows: list[dict[str, Any]], mode: str) -> int | None:
    """The smallest n of the table from which the coordinator's uplink sets the round time."""
    bound = [r["n"] for r in rows if r[mode]["bound_by"] == "coordinator uplink"]
    return bound[0] if bound else None


def print_round_time(report: dict[str, Any]) -> None:
    plans = ", ".join(f"{p['broadcast_density']:g} x {p['broadcast_passes']}: {p['bytes']:,.0f} B"
                      for p in report["aggregate_bytes_by_plan"])
    print(f"2. round communication time: layout {report['layout_params']:,} parameters, worker frame "
          f"{report['worker_frame_bytes']:,.0f} B, aggregate (density x passes) {plans}; "
          f"coordinator uplink {report['coordinator_uplink_mbps']:g} Mbit/s, worker links "
          f"{report['worker_link_mbps']:g} Mbit/s")
    print(f"{'n':>5} | {'frames: down MB':>15} {'coord up MB':>12} {'round s':>9} {'bound by':<19}"
          f"| {'aggregate':>9} {'down MB':>8} {'coord up MB':>12} {'round s':>9} {'bound by':<19}| {'frames/aggr':>11}")
    for r in report["rows"]:
        plan = f"{r['broadcast_density']:g}x{r['broadcast_passes']}"
        cells = "".join(f"| {plan + ' ' if m == 'aggregate' else ''}"
                        f"{r[m]['download_bytes'] / 1e6:>{15 if m == 'frames' else 17 - len(plan)}.2f} "
                        f"{r[m]['coordinator_upload_bytes'] / 1e6:>12.1f} {r[m]['round_comm_s']:>9.3f} "
                        f"{r[m]['bound_by']:<19}" for m in MODES)
        print(f"{r['n']:>5} {cells}| {r['frames']['round_comm_s'] / r['aggregate']['round_comm_s']:>11.1f}")
    for mode in MODES:
        n = report["uplink_bound_from"][mode]
        print(f"{mode}: the coordinator's uplink sets the round time from n = {n}" if n else
              f"{mode}: the coordinator's uplink never sets the round time up to n = {ROUND_TIME_NS[-1]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    report: dict[str, Any] = {}
    if args.only != "round-time":
        rows = loss_rows(args)
        print_loss(args, rows)
        report.update(rows=rows, ratio_mean_worst=max(r["ratio_mean"] for r in rows),
                      ratio_upper95_worst=max(r["ratio_upper95"] for r in rows), rounds=args.rounds,
                      inner_steps=args.inner_steps, seeds=seeds_of(args), model=args.model,
                      batch=[args.batch_size, args.seq_len], val_windows=args.val_windows)
    if args.only != "loss":
        report["round_time"] = round_time(args)
        print_round_time(report["round_time"])
    cfg = run_config(args, 2, "aggregate")
    report = rounded({**report, "wall_s": time.monotonic() - start, "jobs": args.jobs, **provenance(cfg.task)})
    print(f"{time.monotonic() - start:.0f} s")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
