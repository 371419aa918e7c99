"""Chunked top-k, 2-bit quantizer and index coding in plain torch (any device).

The reference for the wire semantics; the fused numba kernel in ``kernels.py`` must give
the same bytes. Selection: the ``k`` largest ``|e|`` per chunk, equal magnitudes broken
by the lower in-chunk position. Quantizer: sign x {lo, hi}, where, with the kept
magnitudes sorted in descending order ``m[0] >= m[1] >= ...`` and ``h = k // 2``,
``hi = m[h // 2]`` and ``lo = m[h + (k - h) // 2]`` (order statistics, so every
implementation agrees bit for bit), both rounded to bfloat16; a magnitude codes as hi
when ``|x| >= (lo + hi) * 0.5`` (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .bits import fixed_width, rice_param, segment_exclusive_cumsum, write_fields
from .layout import ChunkGrid, kept_per_chunk


@dataclass
class TensorPayload:
    """One tensor's share of a sparse frame's sections."""

    table: bytes  # bfloat16 bit patterns (hi, lo) per chunk or per tensor, little-endian
    codes: bytes  # 2-bit codes, 4 per byte, each chunk starting on a byte
    index: bytes  # coded in-chunk positions, each chunk starting on a byte
    index_chunk_bytes: np.ndarray  # bytes of each chunk's coded positions


def chunk_matrix(x: torch.Tensor, g: ChunkGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """(full chunks as an (n, size) matrix, the short last chunk as a vector, maybe empty)."""
    t, s = g.tile, g.size
    x2 = x.reshape(g.rows, g.cols)
    parts = []
    if g.n_tiles:
        tiles = x2[: g.row_tiles * t, : g.col_tiles * t].reshape(g.row_tiles, t, g.col_tiles, t)
        parts.append(tiles.permute(0, 2, 1, 3).reshape(-1, s))
    cw = g.col_tiles * t
    left = torch.cat([x2[:, cw:].reshape(-1), x2[g.row_tiles * t:, :cw].reshape(-1)])
    n_full_left = left.numel() // s
    parts.append(left[: n_full_left * s].reshape(-1, s))
    return torch.cat(parts), left[n_full_left * s:]


def select_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k largest |x| per row; ties go to the lower column."""
    a = x.abs()
    if k >= a.shape[1]:
        return torch.ones_like(a, dtype=torch.bool)
    thr = torch.topk(a, k, dim=1).values[:, -1:]
    gt = a > thr
    eq = a == thr
    need = k - gt.sum(1, keepdim=True)
    return gt | (eq & (torch.cumsum(eq, 1, dtype=torch.int32) <= need))


def levels_from(mags: torch.Tensor) -> torch.Tensor:
    """(rows, 2) bfloat16 (hi, lo) from kept magnitudes (rows, k)."""
    k = mags.shape[1]
    h = k // 2
    srt = torch.sort(mags, dim=1, descending=True).values
    return torch.stack([srt[:, h // 2], srt[:, h + (k - h) // 2]], 1).to(torch.bfloat16)


def quantize(vals: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit codes (bit 0: hi level, bit 1: negative) and decoded values for rows of vals."""
    lv = levels.float()
    hi, lo = lv[:, :1], lv[:, 1:]
    mid = (lo + hi) * 0.5
    is_hi = vals.abs() >= mid
    neg = torch.signbit(vals)
    mag = torch.where(is_hi, hi, lo)
    dec = torch.where(neg, -mag, mag)
    return is_hi.to(torch.uint8) | (neg.to(torch.uint8) << 1), dec


def encode_tensor(e: torch.Tensor, g: ChunkGrid, k_full: int, per_chunk: bool, fixed: bool) -> TensorPayload:
    """Select, quantize and code one error-feedback tensor (fp32, flat); subtracts the decoded
    values from ``e`` in place."""
    full, short = chunk_matrix(e, g)
    groups = [(full, kept_per_chunk(g.size, k_full, g.size))]
    if short.numel():
        groups.append((short.view(1, -1), kept_per_chunk(short.numel(), k_full, g.size)))
    sel = [(x, select_topk(x, k)) for x, k in groups if x.shape[0]]
    pos = [m.nonzero()[:, 1].view(x.shape[0], -1) for x, m in sel]
    vals = [x[m].view(x.shape[0], -1) for x, m in sel]
    if per_chunk:
        levels = [levels_from(v.abs()) for v in vals]
    else:
        flat = torch.cat([v.reshape(-1) for v in vals]).abs().view(1, -1)
        levels = [levels_from(flat).expand(v.shape[0], 2) for v in vals]
    q = [quantize(v, lv) for v, lv in zip(vals, levels, strict=False)]
    # e -= decoded, at the kept coordinates
    chunk_ids = torch.cat([
        torch.arange(p.shape[0], device=e.device).repeat_interleave(p.shape[1]) + off
        for p, off in zip(pos, (0, full.shape[0]), strict=False)
    ])
    flat_idx = g.flat_index(chunk_ids, torch.cat([p.reshape(-1) for p in pos]))
    e[flat_idx] = torch.cat([v.reshape(-1) for v in vals]) - torch.cat([d.reshape(-1) for _, d in q])
    table = torch.cat(levels) if per_chunk else levels[0][:1]
    ks = [p.shape[1] for p in pos]
    counts = [p.shape[0] for p in pos]
    codes = _pack_codes(torch.cat([c.reshape(-1) for c, _ in q]), ks, counts)
    sizes = [g.size] * full.shape[0] + ([short.numel()] if short.numel() else [])
    index, chunk_bytes = _pack_index(pos, sizes, fixed)
    return TensorPayload(table.contiguous().view(torch.int16).cpu().numpy().tobytes(), codes, index, chunk_bytes)


def _kvec(ks: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.full((c,), k, dtype=torch.int64, device=device) for k, c in zip(ks, counts, strict=False)])


def _pack_codes(codes: torch.Tensor, ks: list[int], counts: list[int]) -> bytes:
    dev = codes.device
    kc = _kvec(ks, counts, dev)
    chunk_bytes = (kc + 3) // 4
    chunk_start = torch.cumsum(chunk_bytes, 0) - chunk_bytes
    seg_start = torch.cumsum(kc, 0) - kc
    j = segment_exclusive_cumsum(torch.ones_like(codes, dtype=torch.int64), seg_start, kc)
    starts = torch.repeat_interleave(chunk_start, kc) * 8 + j * 2
    w = torch.full_like(starts, 2)
    return write_fields(int(chunk_bytes.sum()), starts, codes.to(torch.int64), w, 2).cpu().numpy().tobytes()


def _pack_index(pos: list[torch.Tensor], sizes: list[int], fixed: bool) -> tuple[bytes, np.ndarray]:
    dev = pos[0].device
    ks = [p.shape[1] for p in pos]
    counts = [p.shape[0] for p in pos]
    kc = _kvec(ks, counts, dev)
    torch.tensor(sizes, dtype=torch.int64, device=dev)
    p = torch.cat([x.reshape(-1) for x in pos])
    seg_start = torch.cumsum(kc, 0) - kc
    if fixed:
        w = torch.tensor([fixed_width(n) for n in sizes], dtype=torch.int64, device=dev)
        wv = torch.repeat_interleave(w, kc)
        chunk_bits = kc * w
        values, widths, lengths, maxw = p, wv, wv, int(w.max())
        offsets = segment_exclusive_cumsum(lengths, seg_start, kc)
    else:
        b = torch.tensor([rice_param(n, k) for n, k in zip(sizes, kc.tolist(), strict=False)], dtype=torch.int64, device=dev)
        bv = torch.repeat_interleave(b, kc)
        gaps = torch.cat([(x - prev_of(x) - 1).reshape(-1) for x in pos])
        q = gaps >> bv
        r = gaps & ((1 << bv) - 1)
        lengths = q + 1 + bv
        offsets = segment_exclusive_cumsum(lengths, seg_start, kc)
        chunk_bits = torch.zeros(len(sizes), dtype=torch.int64, device=dev).index_add_(
            0, torch.arange(len(sizes), device=dev).repeat_interleave(kc), lengths)
        # terminator 1-bit after q zeros, then r in b bits: one field (r << 1 | 1) at start + q
        values, widths, maxw = (r << 1) | 1, bv + 1, int(b.max()) + 1
        offsets = offsets + q
    chunk_bytes = (chunk_bits + 7) // 8
    chunk_start = torch.cumsum(chunk_bytes, 0) - chunk_bytes
    starts = torch.repeat_interleave(chunk_start, kc) * 8 + offsets
    packed = write_fields(int(chunk_bytes.sum()), starts, values, widths, maxw).cpu().numpy().tobytes()
    return packed, chunk_bytes.cpu().numpy()


def prev_of(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.full((x.shape[0], 1), -1, device=x.device, dtype=x.dtype), x[:, :-1]], 1)
