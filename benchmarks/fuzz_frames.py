"""Mutation fuzzing of the frame decoder: does any mutated frame crash it?

Mutates valid sparse and dense frames (bit flips, byte overwrites, truncation, extension,
concatenation, splices, header-field rewrites), half of them with the checksum and length
fields repaired so that the structural validation is reached, and decodes each. Every
outcome must be a clean decode or a FrameError; anything else is a crash. Each frame also
goes through ``decode_apply`` into fp32 parameters: it must raise the same FrameError and
leave them bit for bit as they were, or add exactly what ``decode_frame`` +
``apply_frames`` add; a difference counts as a crash too.

    python -m benchmarks.fuzz_frames --count 100000 --seed 0

Prints a table and one JSON line; exits 1 when crashed > 0.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time
import traceback
import zlib

import torch

from benchmarks.provenance import provenance
from geoloco.compression import (
    Compressor,
    FrameError,
    Layout,
    TensorSpec,
    apply_frames,
    decode_apply,
    decode_frame,
    encode_dense,
)
from geoloco.compression.format import HEADER_BYTES

_ROUND_AT, _SENDER_AT = 24, 32  # offsets of round (u64) and sender (u32) in the header (docs/codec.md)

FUZZ_SPECS = [
    TensorSpec("emb", (96, 64), torch.float32),
    TensorSpec("w", (70, 130), torch.float32),
    TensorSpec("b", (70,), torch.float32),
    TensorSpec("s", (), torch.float32),
    TensorSpec("conv", (3, 5, 7), torch.bfloat16),
]


def seed_frames(layout: Layout) -> list[bytes]:
    """A few valid frames of every flavour for the layout."""
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(s.shape, generator=g) for s in layout.specs]
    frames = []
    for coding in ("rice", "fixed"):
        for table in ("chunk", "tensor", "bins"):
            for zstd in (False, True):
                c = Compressor(layout, density=1 / 16, tile=16, index_coding=coding, table=table, zstd=zstd)
                frames.append(c.compress(deltas, round=3, sender=1))
    frames.append(encode_dense(layout, deltas, round=1, sender=2, dtype="bf16"))
    frames.append(encode_dense(layout, deltas, round=1, sender=2, dtype="fp32", zstd=True))
    return frames


def repair(data: bytearray) -> bytearray:
    """Rewrite the body length and checksum so that the frame passes those two checks."""
    if len(data) >= HEADER_BYTES + 4:
        struct.pack_into("<Q", data, HEADER_BYTES - 8, len(data) - HEADER_BYTES - 4)
        struct.pack_into("<I", data, len(data) - 4, zlib.crc32(bytes(data[:-4])))
    return data


def stamped(frame: bytes, round_: int, sender: int) -> bytes:
    """``frame`` with its round and sender rewritten and the checksum fixed (a frame for
    another round or worker without encoding it again)."""
    d = bytearray(frame)
    struct.pack_into("<Q", d, _ROUND_AT, round_)
    struct.pack_into("<I", d, _SENDER_AT, sender)
    struct.pack_into("<I", d, len(d) - 4, zlib.crc32(bytes(d[:-4])))
    return bytes(d)


def mutate(rng: random.Random, frame: bytes, frames: list[bytes]) -> bytes:
    d = bytearray(frame)
    op = rng.randrange(9)
    if op == 0:  # flip a few bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(d) * 8)
            d[i // 8] ^= 1 << (i % 8)
    elif op == 1:  # overwrite bytes
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(len(d))] = rng.randrange(256)
    elif op == 2:  # truncate
        d = d[:rng.randrange(len(d))]
    elif op == 3:  # extend
        d += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif op == 4:  # concatenate
        d += rng.choice(frames)
    elif op == 5:  # splice a range from another frame
        other = rng.choice(frames)
        i, j = sorted(rng.randrange(len(d)) for _ in range(2))
        k = rng.randrange(len(other))
        d[i:j] = other[k:k + (j - i) + rng.randint(-4, 4)]
    elif op == 6:  # rewrite a header field with an extreme value
        pos = rng.randrange(4, HEADER_BYTES)
        d[pos:pos + 4] = rng.choice([b"\xff\xff\xff\xff", b"\0\0\0\0", b"\x01\0\0\0", b"\xff\xff\xff\x7f"])
        d = d[:len(frame)]
    elif op == 7:  # rewrite a section length
        pos = rng.randrange(HEADER_BYTES, max(HEADER_BYTES + 1, len(d) - 8))
        d[pos:pos + 8] = struct.pack("<Q", rng.choice([0, 1, 2**63, 2**64 - 1, rng.randrange(1 << 20)]))
        d = d[:len(frame)]
    else:  # delete a range
        i = rng.randrange(len(d))
        del d[i:i + rng.randint(1, 32)]
    if rng.random() < 0.5:
        d = repair(d)
    return bytes(d)


def check_accepted(frame, layout: Layout) -> None:
    """A frame that decoded must describe a sane update."""
    for spec, idx, val in zip(layout.specs, frame.indices or [], frame.values or [], strict=False):
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= spec.numel):
            raise AssertionError(f"accepted frame has an index outside {spec.name}")
        if len(torch.unique(idx)) != len(idx):
            raise AssertionError(f"accepted frame repeats an index in {spec.name}")
        if not torch.isfinite(val).all():
            raise AssertionError("accepted frame has non-finite values")
    frame.to_dense()


def check_apply(data: bytes, layout: Layout, start: list[torch.Tensor], frame, error: str | None) -> None:
    """decode_apply on the same bytes: the same error with the parameters untouched, or
    the same parameters as decode_frame + apply_frames."""
    params = [p.clone() for p in start]
    try:
        decode_apply(params, data, layout, weight=0.5, alpha=-0.25)
    except FrameError as exc:
        if error != str(exc):
            raise AssertionError(f"decode_apply raised {exc!r}, decode_frame {error!r}") from None
        if not all(torch.equal(a, b) for a, b in zip(params, start, strict=True)):
            raise AssertionError(f"decode_apply changed the parameters before raising {exc!r}") from None
        return
    if error is not None:
        raise AssertionError(f"decode_apply took a frame decode_frame refused: {error}")
    want = [p.clone() for p in start]
    apply_frames(want, [frame], [0.5], alpha=-0.25)
    if not all(torch.equal(a, b) for a, b in zip(params, want, strict=True)):
        raise AssertionError("decode_apply added something else than decode_frame + apply_frames")


def run(count: int, seed: int) -> dict:
    layout = Layout(FUZZ_SPECS)
    frames = seed_frames(layout)
    for f in frames:
        decode_frame(f, layout)  # the seeds themselves must decode
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(s.shape, generator=g) for s in layout.specs]  # fp32: decode_apply's one-pass path
    rng = random.Random(seed)
    counts = {"rejected": 0, "accepted": 0, "crashed": 0}
    first_crash = None
    t0 = time.perf_counter()
    for _ in range(count):
        data = mutate(rng, rng.choice(frames), frames)
        try:
            f, error = None, None
            try:
                f = decode_frame(data, layout)
                check_accepted(f, layout)
            except FrameError as exc:
                error = str(exc)
            check_apply(data, layout, start, f, error)
            counts["rejected" if error else "accepted"] += 1
        except Exception:  # noqa: BLE001 - anything else is what we are looking for
            counts["crashed"] += 1
            if first_crash is None:
                first_crash = traceback.format_exc()
    counts["seconds"] = round(time.perf_counter() - t0, 2)
    counts["count"] = count
    if first_crash:
        print(first_crash, file=sys.stderr)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    r = run(args.count, args.seed)
    print(f"{'frames':>10} {'rejected':>10} {'accepted':>10} {'crashed':>10} {'seconds':>8}")
    print(f"{r['count']:>10} {r['rejected']:>10} {r['accepted']:>10} {r['crashed']:>10} {r['seconds']:>8}")
    print(json.dumps({**r, **provenance()}))
    return 1 if r["crashed"] else 0


if __name__ == "__main__":
    sys.exit(main())
