"""How the coordinator scales with the number of workers: simulated workers push real
SparseLoCo frames of GPT-2's 124M-parameter layout over real gRPC (no training) into a
coordinator process, n = 4, 16, 64 and 128, for each round-result mode asked
(``--broadcast``, coordinator.broadcast: ``frames`` sends the round's n worker frames to
every worker, ``aggregate`` one frame the coordinator compresses from their aggregate with
its own error feedback, ``auto`` the smaller of the two). ``aggregate`` runs at the config's
broadcast density and passes unless ``--broadcast-density`` / ``--broadcast-passes`` say
otherwise: by default the union of the round's frames, at most a quarter a frame, in up to
four frames, so its download grows with n up to n = 64; ``--broadcast-density 0.03125``
(twice the workers') is the one-frame setting whose download does not.

Per mode and n it prints the coordinator's round-close time (the last frame's bytes in -> validated,
broadcast, applied and digested: metrics.jsonl's close_seconds + coordinator_apply_seconds),
frames/s and MB/s decoded over that time, p50/p99 push latency as the workers saw it, the
coordinator's peak RSS over the rounds, while one worker fetches the state before them
(``fetch RSS``: its dense frame, a model's size) and while it writes a checkpoint after them
(``ckpt RSS``: its parameters, and under ``aggregate`` its error feedback), the bytes each worker downloads
per round and the coordinator's upload per round (n x that: the simulated workers do not
follow the Rounds stream, so it is computed from the round result's size, not sent); then
where the close
goes, phase by phase (the frames' check and decode as they arrive, the frame guard, the
outer step, the round log, the hand-over to the streams, the apply, the digest), with the
coordinator's resident MB at the end of each phase. The coordinator process runs with its
own thread policy (``coordinator_threads``: the codec's kernels on every core, torch's ops on
one), and one frame's decode_apply is measured here on as many codec threads; the simulated
workers make a round's frames and messages before its pushes start, so that only their
sending shares the cores with the coordinator. The targets at
n = 64: close time <= 1.5 x (n x one frame's decode_apply time, measured just before and
just after that run, in this process), and
peak RSS <= model + optimizer state + 2 x the frames in flight + 500 MB. SparseLoCo's outer
SGD keeps no state; under ``aggregate`` the coordinator's error feedback (one fp32 copy of
the model) counts as its optimizer state. Under ``aggregate``, also: the download per
worker <= 2 x one worker's upload frame. Under ``frames`` the download is the round's n
frames and grows linearly in n (docs/benchmarks.md says what that means). The JSON line
holds every row and, per mode, the ratios at n = 64 (or the largest n run).

    python -m benchmarks.scale                          # frames and aggregate, n = 4, 16, 64, 128
    python -m benchmarks.scale --broadcast frames --ns 64
    python -m benchmarks.scale --broadcast aggregate --broadcast-density 0.03125   # one frame, whatever n
    python -m benchmarks.scale --quick                  # a 3M-parameter layout, n = 2, 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from benchmarks.fuzz_frames import stamped
from benchmarks.provenance import provenance
from geoloco import transport
from geoloco.compression import Compressor, Layout, TensorSpec, decode_apply, decode_frame
from geoloco.compression.memory import huge_page_buffer
from geoloco.config import load_config
from geoloco.coordinator.metrics import CLOSE_PHASES
from geoloco.coordinator.outer import broadcast_density, broadcast_passes
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc

TOKEN = "scale-benchmark"
ROUNDS = 4  # the first is a warm-up; figures are medians of the rest
DEFAULT_NS = (4, 16, 64, 128)
QUICK_NS = (2, 4)
TARGET_N = 64  # where the targets are judged (the largest n run, if smaller)
MODES = ("frames", "aggregate", "auto")
RSS_SLACK_MB = 500
RSS_FILE = "peak_rss_mb"  # the coordinator process writes its peak RSS here


def gpt2_layout(n_layer: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> Layout:
    """GPT-2's parameter layout (124,439,808 parameters at the defaults; the head is tied)."""
    specs = [TensorSpec("wte", (vocab, d), torch.float32), TensorSpec("wpe", (ctx, d), torch.float32)]
    for i in range(n_layer):
        for name, shape in (("ln_1.weight", (d,)), ("ln_1.bias", (d,)), ("attn.c_attn.weight", (d, 3 * d)),
                            ("attn.c_attn.bias", (3 * d,)), ("attn.c_proj.weight", (d, d)),
                            ("attn.c_proj.bias", (d,)), ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
                            ("mlp.c_fc.weight", (d, 4 * d)), ("mlp.c_fc.bias", (4 * d,)),
                            ("mlp.c_proj.weight", (4 * d, d)), ("mlp.c_proj.bias", (d,))):
            specs.append(TensorSpec(f"h.{i}.{name}", shape, torch.float32))
    specs += [TensorSpec("ln_f.weight", (d,), torch.float32), TensorSpec("ln_f.bias", (d,), torch.float32)]
    return Layout(specs)


def layout_for(quick: bool) -> Layout:
    return gpt2_layout(n_layer=2, d=256, vocab=8192, ctx=256) if quick else gpt2_layout()


def run_config(n: int, run_dir: Path, broadcast: str = "frames", density: float | None = None,
               passes: int | None = None):
    """The coordinator's run config; ``density`` and ``passes``: coordinator.broadcast_density
    and broadcast_passes (None: the config's default, which follows n)."""
    return load_config(overrides={
        "workers": n, "rounds": ROUNDS, "run_dir": str(run_dir), "coordinator.listen": "127.0.0.1:0",
        "coordinator.token": TOKEN, "coordinator.deadline_s": 600.0, "coordinator.join_timeout_s": 1.0,
        "coordinator.checkpoint_every": 0, "coordinator.val_every": 0, "coordinator.broadcast": broadcast,
        "coordinator.broadcast_density": density, "coordinator.broadcast_passes": passes})


class NoValidation:
    """The round loop's task without data: no validation loss (this is not training)."""

    def val_loss(self, model: nn.Module) -> float:
        return float("nan")


def serve(n: int, run_dir: Path, quick: bool, broadcast: str, density: float | None = None,
          passes: int | None = None) -> int:
    """The coordinator process: the real state, servicer, round loop and server, over the
    layout's parameters instead of a model built from a task."""
    from grpc_health.v1 import health

    from geoloco.coordinator.app import coordinator_threads
    from geoloco.coordinator.app import serve as start_server
    from geoloco.coordinator.gradient_coding import make_code
    from geoloco.coordinator.loop import RoundLoop
    from geoloco.coordinator.metrics import RunTotals
    from geoloco.coordinator.outer import make_outer
    from geoloco.coordinator.registry import WorkerRegistry
    from geoloco.coordinator.roundlog import FrameSpool
    from geoloco.coordinator.rounds import CodePolicy, RoundState
    from geoloco.coordinator.service import CoordinatorServicer
    from geoloco.coordinator.state import CoordinatorState
    from geoloco.run_dir import PORT_FILE, write_atomic

    cfg = run_config(n, run_dir, broadcast, density, passes)
    coordinator_threads()  # the coordinator's process policy: threads and malloc arenas
    layout = layout_for(quick)
    params = zero_params(layout)
    code = make_code("none", n, 0, 0)
    state = CoordinatorState(layout, params, WorkerRegistry(n, TOKEN), RunTotals(),
                             RoundState(0, cfg.coordinator.deadline_s), spool=FrameSpool(run_dir))
    loop = RoundLoop(cfg, state, CodePolicy(code), make_outer(cfg, layout),
                     NoValidation(), nn.Module(), run_dir)
    server, port = start_server(cfg, CoordinatorServicer(state, cfg, layout, code), health.HealthServicer(), None)
    write_atomic(run_dir / PORT_FILE, f"{port}\n")
    loop.measure_initial_loss()
    if state.wait_for_joins(n, cfg.coordinator.join_timeout_s):
        while state.open_round() < cfg.rounds:  # the loop's rounds; no worker waits for the end
            loop.run_round()
    peaks = {"rounds": peak_rss_mb(), "checkpoint": None}
    if reset_peak_rss():  # then a checkpoint of the round reached (coordinator.checkpoint_every)
        loop.save_checkpoint(state.open_round())
        peaks["checkpoint"] = peak_rss_mb()
    write_atomic(run_dir / RSS_FILE, json.dumps(peaks) + "\n")
    server.stop(1.0).wait()
    state.spool.close()
    return 0


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Set a process's peak resident set (VmHWM) to its present one (Linux's clear_refs
    "5"); False where that is not possible."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak resident set since it started (or since ``reset_peak_rss``), in MB
    of 10^6 bytes like every other figure here (VmHWM, in KiB: reset at exec, unlike
    getrusage's maximum, which a forked child inherits from its parent)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def measure(n: int, base: bytes, quick: bool, tmp: Path, broadcast: str = "frames", density: float | None = None,
            passes: int | None = None) -> dict:
    """One coordinator process with ``n`` simulated workers for ROUNDS rounds."""
    run_dir = tmp / f"{broadcast}-n{n}"
    run_dir.mkdir()
    log = open(run_dir / "coordinator.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.scale", "--serve", str(n), "--run-dir",
                             str(run_dir), "--broadcast", broadcast, *(["--quick"] if quick else []),
                             *([f"--broadcast-density={density}"] if density is not None else []),
                             *([f"--broadcast-passes={passes}"] if passes is not None else [])], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        port_file = run_dir / "coordinator.port"
        while not (port_file.exists() and port_file.read_text().strip().isdigit()):
            if proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited; see {run_dir / 'coordinator.log'}")
            time.sleep(0.1)
        channel = transport.open_channel(f"127.0.0.1:{int(port_file.read_text())}")
        stub = geoloco_pb2_grpc.CoordinatorStub(channel)
        request = pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION)
        joins = [stub.Join(request, timeout=60) for _ in range(n)]
        # one of them fetches the state of round 0, as every real worker does (the coordinator
        # must not keep its dense frame, a model's size, for the rounds after)
        fetch = pb.FetchStateRequest(worker_id=joins[0].worker_id, session=joins[0].session)
        state_bytes = sum(len(c.data) for c in stub.FetchState(fetch, timeout=600))
        assert state_bytes > 4 * sum(s.numel for s in layout_for(quick).specs), state_bytes
        fetch_rss = peak_rss_mb(proc.pid)  # the coordinator's peak so far: the fetch's
        reset_peak_rss(proc.pid)  # the rounds' peak from here
        latencies: list[float] = []
        lock = threading.Lock()

        def messages(j: pb.JoinReply, round_: int) -> list[pb.PushChunk]:
            data = stamped(base, round_, j.worker_id)
            header = pb.PushHeader(worker_id=j.worker_id, session=j.session, round=round_, total_bytes=len(data))
            return [pb.PushChunk(header=header)] + [pb.PushChunk(data=c) for c in transport.chunks(data)]

        def push(j: pb.JoinReply, round_: int, chunks: list[pb.PushChunk]) -> None:
            start = time.monotonic()
            reply = stub.Push(iter(chunks), metadata=transport.caller_metadata(j.worker_id, j.session), timeout=600)
            if not reply.accepted:
                raise RuntimeError(f"push refused: {reply.reason}")
            with lock:
                if round_ > 0:
                    latencies.append(time.monotonic() - start)

        with ThreadPoolExecutor(n) as pool:
            for r in range(ROUNDS):
                # each worker's frame and messages made before any is sent: a real worker's
                # encoding is not on the coordinator's cores
                chunks = [messages(j, r) for j in joins]
                list(pool.map(lambda j, c, r=r: push(j, r, c), joins, chunks))
                del chunks
                metrics = run_dir / "metrics.jsonl"
                while not metrics.exists() or len(metrics.read_text().splitlines()) <= r:
                    if proc.poll() is not None:
                        raise RuntimeError(f"the coordinator exited; see {run_dir / 'coordinator.log'}")
                    time.sleep(0.05)
        channel.close()
        assert proc.wait(timeout=600) == 0, (run_dir / "coordinator.log").read_text()[-3000:]
        peaks = json.loads((run_dir / RSS_FILE).read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    close = statistics.median(m["close_seconds"] + m["coordinator_apply_seconds"] for m in lines)
    latencies.sort()
    down = statistics.median(m["download_bytes_per_worker"] for m in lines)
    cfg = run_config(n, run_dir, broadcast, density, passes)
    return {"broadcast": broadcast, "n": n, "broadcast_density": broadcast_density(cfg),
            "broadcast_passes": broadcast_passes(cfg), "close_s": close, "frames_per_s": n / close,
            "mb_per_s": n * len(base) / close / 1e6,
            "push_p50_s": latencies[len(latencies) // 2], "push_p99_s": latencies[int(0.99 * (len(latencies) - 1))],
            "peak_rss_mb": peaks["rounds"], "checkpoint_rss_mb": peaks["checkpoint"], "fetch_rss_mb": fetch_rss,
            "download_bytes_per_worker": down, "coordinator_upload_bytes": n * down,
            "sent_as": sorted({m["broadcast"] for m in lines}), **close_breakdown(lines)}


def close_breakdown(lines: list[dict]) -> dict:
    """Where the close went (metrics.jsonl's close_phases, median over the rounds): the
    frames' check and decode as they arrived (decode_seconds x frames: before the close,
    on the Push threads), then each phase after the close decision; and the resident MB at
    the end of each phase (the largest over the rounds)."""
    phases = {"validate": statistics.median(m["decode_seconds"] * len(m["arrived"]) for m in lines)}
    phases |= {p: statistics.median(m["close_phases"][p] for m in lines) for p in CLOSE_PHASES}
    rss = {p: max(m["close_rss_bytes"][p] or 0 for m in lines) / 1e6 for p in CLOSE_PHASES}
    return {"phases_s": phases, "rss_mb_by_phase": rss}


def zero_params(layout: Layout) -> list[torch.Tensor]:
    """The layout's parameters, zero, as views of one huge-page buffer (no second copy)."""
    buf, out, off = huge_page_buffer(layout.numel), [], 0
    for spec in layout.specs:
        out.append(buf[off:off + spec.numel].view(spec.shape))
        off += spec.numel
    return out


def decode_apply_s(layout: Layout, base: bytes) -> float:
    """One frame's decode_apply into the layout's parameters, median of five."""
    params = zero_params(layout)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        decode_apply(params, base, layout, weight=1.0 / 64, alpha=-1.0)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def modes_arg(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--broadcast takes a comma list of {', '.join(MODES)}; got {text!r}")
    return modes


def ns_arg(text: str) -> tuple[int, ...]:
    try:
        ns = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        ns = ()
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"--ns takes a comma list of worker counts >= 1; got {text!r}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 3M-parameter layout, n = 2 and 4")
    ap.add_argument("--broadcast", type=modes_arg, default=("frames", "aggregate"),
                    help="round-result modes to run, comma separated: frames, aggregate, auto "
                         "(default: frames,aggregate)")
    ap.add_argument("--ns", type=ns_arg, help=f"worker counts, comma separated (default: "
                    f"{','.join(map(str, DEFAULT_NS))}; --quick: {','.join(map(str, QUICK_NS))})")
    ap.add_argument("--broadcast-density", type=float, help="coordinator.broadcast_density of the "
                    "aggregate runs (default: the config's, the union of the round's frames)")
    ap.add_argument("--broadcast-passes", type=int, help="coordinator.broadcast_passes of the aggregate runs")
    ap.add_argument("--serve", type=int, metavar="N", help=argparse.SUPPRESS)  # the coordinator process
    ap.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.run_dir, args.quick, args.broadcast[0], args.broadcast_density,
                     args.broadcast_passes)
    layout = layout_for(args.quick)
    ns = args.ns or (QUICK_NS if args.quick else DEFAULT_NS)
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(s.shape, generator=gen) * 1e-3 for s in layout.specs]
    base = Compressor(layout).compress(deltas, round=0, sender=0)
    del deltas
    decode_frame(base, layout)  # compiled kernels ready
    model_mb = layout.numel * 4 / 1e6
    rows = []
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        for mode in args.broadcast:
            for n in ns:
                print(f"{mode}, n = {n} ...", file=sys.stderr, flush=True)
                # the reference beside each run, just before and just after it: this machine's
                # speed moves between runs, and the target moves with it
                before = decode_apply_s(layout, base)
                row = measure(n, base, args.quick, Path(tmp), mode, args.broadcast_density, args.broadcast_passes)
                row["decode_apply_s"] = (before + decode_apply_s(layout, base)) / 2
                rows.append(row)
    one = statistics.median(r["decode_apply_s"] for r in rows)
    print(f"layout {layout.numel:,} parameters ({model_mb:.0f} MB fp32), frame {len(base):,} bytes, "
          f"decode_apply of one frame {one * 1e3:.1f} ms (median over the runs; each run's target takes "
          f"its own, measured just before and after it)")
    print(f"{'mode':>9} {'n':>4} {'close s':>8} {'target s':>9} {'dec.ap ms':>9} {'frames/s':>9} {'push p50':>9} "
          f"{'push p99':>9} {'peak RSS MB':>12} {'fetch RSS':>10} {'ckpt RSS':>9} {'RSS target':>11} {'down/worker MB':>15} "
          f"{'coord up MB':>12}"
          f"  {'aggregate':<9}")
    for r in rows:
        state_mb = model_mb if r["broadcast"] != "frames" else 0.0  # the coordinator's error feedback
        r["close_target_s"] = 1.5 * r["n"] * r["decode_apply_s"]
        r["rss_target_mb"] = model_mb + state_mb + 2 * r["n"] * len(base) / 1e6 + RSS_SLACK_MB
        print(f"{r['broadcast']:>9} {r['n']:>4} {r['close_s']:>8.3f} {r['close_target_s']:>9.3f} "
              f"{r['decode_apply_s'] * 1e3:>9.2f} "
              f"{r['frames_per_s']:>9.1f} {r['push_p50_s']:>9.3f} {r['push_p99_s']:>9.3f} "
              f"{r['peak_rss_mb']:>12.0f} {r['fetch_rss_mb']:>10.0f} {r['checkpoint_rss_mb'] or float('nan'):>9.0f} "
              f"{r['rss_target_mb']:>11.0f} "
              f"{r['download_bytes_per_worker'] / 1e6:>15.2f} {r['coordinator_upload_bytes'] / 1e6:>12.1f}  "
              + (f"{r['broadcast_density']:g} x {r['broadcast_passes']}" if r["broadcast"] != "frames" else "-"))
    print("\nwhere the close goes (s, median over rounds; resident MB at the end of each phase, max):")
    print(f"{'mode':>9} {'n':>4} " + " ".join(f"{p:>10}" for p in rows[0]["phases_s"]) + "  | "
          + " ".join(f"{p:>9}" for p in CLOSE_PHASES))
    for r in rows:
        print(f"{r['broadcast']:>9} {r['n']:>4} " + " ".join(f"{v:>10.4f}" for v in r["phases_s"].values())
              + "  | " + " ".join(f"{r['rss_mb_by_phase'][p]:>9.0f}" for p in CLOSE_PHASES))
    judged = {}
    for mode in args.broadcast:
        mine = [r for r in rows if r["broadcast"] == mode]
        at = max((r for r in mine if r["n"] <= TARGET_N), key=lambda r: r["n"], default=mine[0])
        judged[mode] = {"n": at["n"], "close_ratio": at["close_s"] / at["close_target_s"],
                        "rss_ratio": at["peak_rss_mb"] / at["rss_target_mb"],
                        "checkpoint_rss_ratio": (at["checkpoint_rss_mb"] or float("nan")) / at["rss_target_mb"],
                        "download_over_upload_frame": at["download_bytes_per_worker"] / len(base)}
    print("\ntargets (close <= 1.5 n decode_apply; RSS <= bound; aggregate: download <= 2 upload frames):")
    for mode, j in judged.items():
        print(f"{mode:>9} n = {j['n']}: close {j['close_ratio']:.2f} x target, RSS {j['rss_ratio']:.2f} x bound "
              f"({j['checkpoint_rss_ratio']:.2f} x while it writes a checkpoint), "
              f"download {j['download_over_upload_frame']:.2f} upload frames")
    print(json.dumps({"params": layout.numel, "frame_bytes": len(base), "decode_apply_s": one,
                      "rows": rows, "targets": judged, **provenance()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
