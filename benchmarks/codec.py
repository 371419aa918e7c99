"""How many bytes does the SparseLoCo codec send, how fast does it encode and decode, and
how much error does the 2-bit quantizer add?

    python -m benchmarks.codec            # 4096x4096 fp32 matrix + a ~24M-parameter GPT layout
    python -m benchmarks.codec --quick    # small smoke sizes
    python -m benchmarks.codec --apply    # several frames at once, n = 4 and 16, a 33.8M GPT layout

Definitions (all GB/s count fp32 pseudo-gradient bytes, 4 per parameter):
- encode: ``Compressor.compress`` (error feedback, top-k, quantize, code, frame).
- decode+apply: ``decode_apply`` into fp32 parameters: the frame is validated and added
  in one pass (a bad frame leaves them as they were), with the bits of ``decode_frame``
  + ``apply_frames``.
- ef_pass: ``e.mul_(beta).add_(delta)`` on the compressor's own buffers, same run.
- rel_error_vs_exact_topk: from a zero error state, ``||decoded - topk(e)|| / ||topk(e)||``
  where ``topk(e)`` keeps the exact per-chunk top-k of ``e`` unquantized (the error the
  2-bit values add on top of sparsification).
- entropy bound: ``log2(C(4096, 64)) / 64`` bits per index, the least any index code can
  average for 64 positions out of 4096.
Timings are the median of several repeats after a warm-up (numba compilation excluded).
The JSON line (last) sums over the workloads: bytes / params, fp32 bytes / total seconds.

``--apply`` times, side by side in one process (interleaved), what a round's n frames cost
to apply once checked, per frame: ``apply_frames`` over n frames (mean over keepers, and
sum; a checked frame holds its bytes, and the kernel decodes its positions a slab at a
time), the same over frames that hold their decoded positions (``fused held``,
``decode_frame(keep_positions=True)``, 2 bytes a kept element: what a worker keeps), the
torch path it replaced (the reference's ``add_frames``: torch ``index_add_`` over
int64 indices), n one-frame ``decode_apply`` calls (validation included), and the
worker's round (``decode_frame`` of each frame keeping its positions, then ``geoloco.replica.apply_round`` with
``mean_kept``). Target: ``apply_frames`` over n frames <= 1.5 x n x one ``decode_apply``.
Then the latency of a tiny torch op (``ones_like`` and ``cat`` on 65 K floats) at this
process's torch thread count, alone and while another thread decodes frames on the
codec's threads: the stall of torch's parallel regions beside them (``--codec-threads``
sets the codec's count apart from torch's; docs/decisions.md, "Thread policy").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable

# as in geoloco's processes (geoloco/__init__.py): torch's OpenMP threads sleep after an
# op instead of spinning on the cores the codec's threads need; set before torch loads
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from benchmarks.provenance import provenance
from geoloco.compression import (  # noqa: E402
    Compressor,
    Layout,
    TensorSpec,
    apply_frames,
    codec_threads,
    decode_apply,
    decode_frame,
    on_huge_pages,
    registry,
    set_codec_threads,
)
from geoloco.replica import apply_round  # noqa: E402

BETA = 0.95
APPLY_TARGET = 1.5  # apply_frames over n frames <= this x n x one decode_apply


def gpt_layout(vocab: int, d: int, layers: int, ctx: int) -> Layout:
    """Parameter layout of a GPT-2-style model (tied head), built from specs alone."""
    f = torch.float32
    specs = [TensorSpec("wte", (vocab, d), f), TensorSpec("wpe", (ctx, d), f)]
    for i in range(layers):
        p = f"h{i}."
        specs += [
            TensorSpec(p + "ln1.weight", (d,), f), TensorSpec(p + "ln1.bias", (d,), f),
            TensorSpec(p + "attn.c_attn.weight", (d, 3 * d), f), TensorSpec(p + "attn.c_attn.bias", (3 * d,), f),
            TensorSpec(p + "attn.c_proj.weight", (d, d), f), TensorSpec(p + "attn.c_proj.bias", (d,), f),
            TensorSpec(p + "ln2.weight", (d,), f), TensorSpec(p + "ln2.bias", (d,), f),
            TensorSpec(p + "mlp.c_fc.weight", (d, 4 * d), f), TensorSpec(p + "mlp.c_fc.bias", (4 * d,), f),
            TensorSpec(p + "mlp.c_proj.weight", (4 * d, d), f), TensorSpec(p + "mlp.c_proj.bias", (d,), f),
        ]
    specs += [TensorSpec("ln_f.weight", (d,), f), TensorSpec("ln_f.bias", (d,), f)]
    return Layout(specs)


def pseudo_gradients(layout: Layout, seed: int = 0) -> list[torch.Tensor]:
    """Gaussian values with a log-normal scale per row, like real pseudo-gradients whose
    magnitude differs between rows (tokens, heads, neurons)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in layout.specs:
        x = torch.randn(s.shape, generator=g) * 1e-3
        if len(s.shape) == 2:
            x *= torch.exp(torch.randn(s.shape[0], 1, generator=g) * 0.7)
        out.append(x)
    return out


def entropy_bound(n: int = 4096, k: int = 64) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2) / k


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def quant_error(layout: Layout, deltas, **kw) -> tuple[float, float, int]:
    """(squared error, squared norm of exact top-k, frame bytes) from a zero error state."""
    c = Compressor(layout, beta=BETA, **kw)
    data = c.compress(deltas, round=0, sender=0)
    f = decode_frame(data, layout)
    err = ref = 0.0
    for d, idx, val in zip(deltas, f.indices, f.values, strict=False):
        exact = d.reshape(-1)[idx]
        err += float(((val - exact) ** 2).sum())
        ref += float((exact ** 2).sum())
    return err, ref, len(data)


def run_workload(name: str, layout: Layout, repeats: int) -> dict:
    deltas = pseudo_gradients(layout)
    c = Compressor(layout, beta=BETA)
    for r in range(2):  # warm-up: numba compilation, buffers, page faults
        frame = c.compress(deltas, round=r, sender=0)
    # parameters as the coordinator and workers hold them: one buffer on huge pages
    params = on_huge_pages([torch.zeros(s.shape) for s in layout.specs])
    decode_apply(params, frame, layout)

    def ef_pass() -> None:
        for e, d in zip(c.error, deltas, strict=False):
            e.mul_(BETA).add_(d.reshape(-1))

    def decode_and_apply() -> None:
        decode_apply(params, frame, layout)

    # interleaved, so that all three see the same machine load
    times = {"enc": [], "ef": [], "dec": []}
    for r in range(repeats):
        times["enc"].append(timed(lambda r=r: c.compress(deltas, round=r, sender=0)))
        times["ef"].append(timed(ef_pass))
        times["dec"].append(timed(decode_and_apply))
    t_enc, t_ef, t_dec = (statistics.median(times[k]) for k in ("enc", "ef", "dec"))
    err, ref, _ = quant_error(layout, deltas)
    n = layout.numel
    gb = 4 * n / 1e9
    return {"name": name, "params": n, "bytes": len(frame), "t_enc": t_enc, "t_ef": t_ef, "t_dec": t_dec,
            "err": err, "ref": ref, "bits_per_param": 8 * len(frame) / n,
            "encode_gbps": gb / t_enc, "decode_apply_gbps": gb / t_dec, "ef_pass_gbps": gb / t_ef}


def design_table(layout: Layout) -> list[tuple[str, str, int, float, float]]:
    """Bytes and error of the quantizer-table and index-coding choices on one layout, for
    row-scaled pseudo-gradients and for i.i.d. Gaussian ones."""
    g = torch.Generator().manual_seed(2)
    data = {"row-scaled": pseudo_gradients(layout, seed=1),
            "iid": [torch.randn(s.shape, generator=g) for s in layout.specs]}
    rows = []
    for kind, deltas in data.items():
        for label, kw in [("table=chunk index=rice", {}),
                          ("table=tensor index=rice", {"table": "tensor"}),
                          ("table=bins index=rice", {"table": "bins"}),
                          ("table=chunk index=fixed", {"index_coding": "fixed"}),
                          ("table=chunk index=rice zstd", {"zstd": True})]:
            err, ref, nbytes = quant_error(layout, deltas, **kw)
            rows.append((kind, label, nbytes, 8 * nbytes / layout.numel, math.sqrt(err / ref)))
    return rows


def apply_ways(layout: Layout, params: list[torch.Tensor], datas: list[bytes]) -> dict:
    """The ways to apply these frames that ``--apply`` compares, as callables."""
    frames, weights = [decode_frame(d, layout) for d in datas], [1.0] * len(datas)
    held = [decode_frame(d, layout, keep_positions=True) for d in datas]
    reference = registry.backend("reference")
    return {
        "torch_mean_kept": lambda: reference.add_frames(layout, params, [f.body for f in held], weights,
                                                        "mean_kept", -1e-3),
        "fused_held": lambda: apply_frames(params, held, weights, mode="mean_kept", alpha=-1e-3),
        "fused_mean_kept": lambda: apply_frames(params, frames, weights, mode="mean_kept", alpha=-1e-3),
        "fused_sum": lambda: apply_frames(params, frames, weights, mode="sum", alpha=-1e-3),
        "decode_apply": lambda: [decode_apply(params, d, layout, weight=1.0, alpha=-1e-3) for d in datas],
        "worker_round": lambda: apply_round(params, [decode_frame(d, layout, keep_positions=True) for d in datas],
                                            weights, "mean_kept", -1e-3),
    }


def apply_rows(layout: Layout, ns: tuple[int, ...], repeats: int) -> list[dict]:
    """Per n: seconds per frame of each way to apply n decoded frames (module docstring),
    medians of ``repeats`` interleaved repetitions after a warm-up."""
    datas = [Compressor(layout, beta=BETA).compress(pseudo_gradients(layout, seed=10 + i), round=0, sender=i)
             for i in range(max(ns))]
    params = on_huge_pages([torch.zeros(s.shape) for s in layout.specs])
    rows = []
    for n in ns:
        ways = apply_ways(layout, params, datas[:n])
        times: dict[str, list[float]] = {k: [] for k in ways}
        for r in range(repeats + 1):
            for k, fn in ways.items():
                t = timed(fn)
                if r:  # the first is a warm-up
                    times[k].append(t)
        row = {"n": n, **{f"{k}_ms": 1e3 * statistics.median(v) / n for k, v in times.items()}}
        row["fused_vs_n_decode_apply"] = row["fused_mean_kept_ms"] / row["decode_apply_ms"]
        row["sum_vs_n_decode_apply"] = row["fused_sum_ms"] / row["decode_apply_ms"]
        row["torch_vs_fused"] = row["torch_mean_kept_ms"] / row["fused_mean_kept_ms"]
        row["bytes_vs_held"] = row["fused_mean_kept_ms"] / row["fused_held_ms"]
        rows.append(row)
    return rows


def tiny_op_us(samples: int = 200, busy: Callable[[], object] | None = None) -> tuple[float, float]:
    """(median, largest) microseconds of ``ones_like`` + ``cat`` on 65 K floats; with
    ``busy``, while another thread calls it over and over (the coordinator's gRPC threads
    decode pushes on the codec's threads while its round loop runs torch ops)."""
    x = torch.zeros(1 << 16)
    times: list[float] = []
    done = threading.Event()

    def keep_busy() -> None:
        while not done.is_set():
            busy()

    other = threading.Thread(target=keep_busy, daemon=True) if busy is not None else None
    if other is not None:
        other.start()
        time.sleep(0.05)
    for _ in range(samples):
        t = time.perf_counter()
        torch.cat([x, torch.ones_like(x)])
        times.append(1e6 * (time.perf_counter() - t))
    done.set()
    if other is not None:
        other.join()
    return statistics.median(times), max(times)


def main_apply(quick: bool, repeats: int | None) -> None:
    layout = gpt_layout(512, 64, 2, 128) if quick else gpt_layout(6144, 768, 4, 1024)
    ns = (2, 4) if quick else (4, 16)
    tiny_first = tiny_op_us(20)  # the first ops of the process, before the codec's threads ran
    rows = apply_rows(layout, ns, repeats or (2 if quick else 5))
    tiny = tiny_op_us()
    frame = Compressor(layout, beta=BETA).compress(pseudo_gradients(layout), round=0, sender=0)
    tiny_busy = tiny_op_us(busy=lambda: decode_frame(frame, layout))
    print(f"several frames at once: {layout.numel:,} parameters, torch threads {torch.get_num_threads()}, "
          f"codec threads {codec_threads()} (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}); "
          "ms per frame, median of", repeats or (2 if quick else 5), "interleaved repeats")
    print(f"{'n':>4}{'torch mean':>12}{'fused held':>12}{'fused mean':>12}{'fused sum':>11}{'decode_apply':>14}"
          f"{'worker round':>14}{'mean/n·d_a':>12}{'sum/n·d_a':>11}{'torch/fused':>13}{'mean/held':>11}")
    for r in rows:
        print(f"{r['n']:>4}{r['torch_mean_kept_ms']:>12.2f}{r['fused_held_ms']:>12.2f}{r['fused_mean_kept_ms']:>12.2f}"
              f"{r['fused_sum_ms']:>11.2f}{r['decode_apply_ms']:>14.2f}{r['worker_round_ms']:>14.2f}"
              f"{r['fused_vs_n_decode_apply']:>12.3f}{r['sum_vs_n_decode_apply']:>11.3f}{r['torch_vs_fused']:>13.1f}"
              f"{r['bytes_vs_held']:>11.3f}")
    print(f"target: fused <= {APPLY_TARGET} x n x one decode_apply; tiny torch op (ones_like + cat, 65 K floats): "
          f"median {tiny[0]:.0f} us, largest {tiny[1]:.0f} us; first 20 ops of the process: median "
          f"{tiny_first[0]:.0f}, largest {tiny_first[1]:.0f} us; while another thread decodes frames: median "
          f"{tiny_busy[0]:.0f}, largest {tiny_busy[1]:.0f} us")
    print(json.dumps({"params": layout.numel, "torch_threads": torch.get_num_threads(),
                      "codec_threads": codec_threads(), "rows": rows,
                      "apply_ratio": max(r["fused_vs_n_decode_apply"] for r in rows),
                      "apply_target": APPLY_TARGET, "tiny_op_us": tiny[0], "tiny_op_max_us": tiny[1],
                      "tiny_op_first_us": tiny_first[0], "tiny_op_busy_us": tiny_busy[0],
                      "tiny_op_busy_max_us": tiny_busy[1],
                      **provenance()}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="SparseLoCo codec benchmark")
    ap.add_argument("--quick", action="store_true", help="small smoke sizes")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--apply", action="store_true", help="several frames at once (see the module docstring)")
    ap.add_argument("--codec-threads", type=int, default=None,
                    help="the codec's threads (default: torch's, which OMP_NUM_THREADS sets)")
    args = ap.parse_args(argv)
    set_codec_threads(args.codec_threads)
    if args.apply:
        main_apply(args.quick, args.repeats)
        return
    if args.quick:
        work = [("matrix_256x256", Layout([TensorSpec("m", (256, 256), torch.float32)])),
                ("gpt_tiny", gpt_layout(512, 64, 2, 128))]
        repeats = args.repeats or 2
    else:
        work = [("matrix_4096x4096", Layout([TensorSpec("m", (4096, 4096), torch.float32)])),
                ("gpt_small", gpt_layout(8192, 512, 6, 1024))]
        repeats = args.repeats or 7
    results = [run_workload(name, lay, repeats) for name, lay in work]
    bound = entropy_bound()

    print(f"torch threads: {torch.get_num_threads()} (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}); "
          f"k = 64 of 4096, beta = {BETA}, defaults "
          "(table per chunk, Rice indices, no zstd); median of", repeats, "repeats")
    hdr = (f"{'workload':<18}{'params':>11}{'bytes':>10}{'bits/par':>9}{'enc GB/s':>9}{'dec+app':>9}"
           f"{'EF GB/s':>9}{'enc/EF':>8}{'dec/EF':>8}{'rel err':>9}")
    print(hdr)
    for r in results:
        print(f"{r['name']:<18}{r['params']:>11}{r['bytes']:>10}{r['bits_per_param']:>9.4f}"
              f"{r['encode_gbps']:>9.3f}{r['decode_apply_gbps']:>9.3f}{r['ef_pass_gbps']:>9.3f}"
              f"{r['encode_gbps'] / r['ef_pass_gbps']:>8.3f}{r['decode_apply_gbps'] / r['ef_pass_gbps']:>8.2f}"
              f"{math.sqrt(r['err'] / r['ref']):>9.4f}")
    print(f"entropy bound log2(C(4096,64))/64 = {bound:.3f} bits per index")
    print("\ndesign choices on", work[0][0], "(bytes and rel. error vs exact top-k):")
    for kind, label, nbytes, bpp, rel in design_table(work[0][1]):
        print(f"  {kind:<11}{label:<30}{nbytes:>10} bytes {bpp:>8.4f} bits/param  rel err {rel:.4f}")

    n = sum(r["params"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    gb = 4 * n / 1e9
    enc = gb / sum(r["t_enc"] for r in results)
    dec = gb / sum(r["t_dec"] for r in results)
    ef = gb / sum(r["t_ef"] for r in results)
    out = {
        "bits_per_param": round(8 * nbytes / n, 5),
        "ratio_vs_fp32": round(4 * n / nbytes, 2),
        "ratio_vs_bf16": round(2 * n / nbytes, 2),
        "encode_gbps": round(enc, 4),
        "decode_apply_gbps": round(dec, 4),
        "ef_pass_gbps": round(ef, 4),
        "encode_vs_ef_pass": round(enc / ef, 4),
        "decode_apply_vs_ef_pass": round(dec / ef, 3),
        "rel_error_vs_exact_topk": round(math.sqrt(sum(r["err"] for r in results) / sum(r["ref"] for r in results)), 5),
        "entropy_bound_bits_per_index": round(bound, 4),
    }
    print(json.dumps({**out, **provenance()}))


if __name__ == "__main__":
    main()
