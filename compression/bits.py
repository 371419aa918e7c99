"""Bit-level primitives shared by the torch and numba paths: bfloat16 rounding, the
Rice parameter, and a vectorized torch bit writer (LSB-first within each byte)."""

from __future__ import annotations

import torch

CODE_BITS = 2


def rice_param(n: int, k: int) -> int:
    """Golomb-Rice parameter for ``k`` sorted positions out of ``n``.

    ``2**b`` close to ``ln 2`` times the mean gap, the optimum for geometric gaps;
    integer-only so that encoder and decoder derive the same value.
    """
    if k <= 0:
        return 0
    return max(0, ((n - k) * 177 // (k * 256)).bit_length() - 1)


def fixed_width(n: int) -> int:
    """Bits per position in the fixed-width index mode (12 for 4096-element chunks)."""
    return max(1, (n - 1).bit_length())


def rice_max_quotient(n: int, b: int) -> int:
    return (n - 1) >> b


def write_fields(nbytes: int, starts: torch.Tensor, values: torch.Tensor, widths: torch.Tensor,
                 max_width: int) -> torch.Tensor:
    """Pack ``values[i]`` (``widths[i]`` bits, LSB first) at bit ``starts[i]`` into a uint8 tensor.

    Fields must not overlap; bits not covered by a field are zero.
    """
    bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=values.device)
    for t in range(max_width):
        m = widths > t
        bits[starts[m] + t] = ((values[m] >> t) & 1).to(torch.uint8)
    weights = (1 << torch.arange(8, device=values.device, dtype=torch.int32))
    return (bits.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def segment_exclusive_cumsum(x: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum of ``x`` restarting at each segment (segments are contiguous)."""
    c = torch.cumsum(x, 0) - x
    base = torch.repeat_interleave(c[seg_start.clamp(max=max(len(x) - 1, 0))] if len(x) else c, seg_len)
    return c - base
