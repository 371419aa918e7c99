"""Property tests (hypothesis): round trips over shapes, tiles, densities, dtypes and value
patterns (ties, denormals, zeros), and bit-identical output from the numba and torch paths."""

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geoloco.compression import Compressor, Layout, TensorSpec, apply_frames, decode_frame
from geoloco.compression.layout import ChunkGrid, kept_per_chunk
from geoloco.compression.registry import BACKENDS

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 150), min_size=1, max_size=1).map(tuple),
    st.lists(st.integers(1, 90), min_size=2, max_size=2).map(tuple),
    st.lists(st.integers(1, 9), min_size=3, max_size=3).map(tuple),
)
patterns = st.sampled_from(["normal", "ties", "denormal", "zeros", "huge_range"])
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def make(shape, pattern, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if pattern == "normal":
        x = torch.randn(n, generator=g)
    elif pattern == "ties":
        x = torch.randint(-3, 4, (n,), generator=g).float()
    elif pattern == "denormal":
        x = torch.randint(-5, 6, (n,), generator=g).float() * 1e-40
    elif pattern == "zeros":
        x = torch.zeros(n)
    else:
        span = 10 if dtype == torch.float16 else 60
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-span, span, (n,), generator=g).float())
    return x.reshape(shape).to(dtype)


@functools.lru_cache(maxsize=256)
def chunk_of(grid: ChunkGrid) -> torch.Tensor:
    """The chunk of each element, by flat index (a grid's is computed once)."""
    sizes = torch.tensor(grid.chunk_sizes())
    chunk = torch.repeat_interleave(torch.arange(grid.n_chunks), sizes)
    pos = torch.arange(grid.numel) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    out = torch.empty(grid.numel, dtype=torch.int64)
    out[grid.flat_index(chunk, pos)] = chunk
    return out


settings.register_profile("codec", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("codec")


@given(st.lists(shapes, min_size=1, max_size=3), st.sampled_from([1, 2, 3, 4, 8, 16, 64]),
       st.floats(0.001, 1.0), patterns, dtypes, st.sampled_from(["rice", "fixed"]),
       st.sampled_from(["chunk", "tensor"]), st.integers(0, 2**16))
def test_roundtrip(shape_list, tile, density, pattern, dtype, coding, table, seed):
    specs = [TensorSpec(f"t{i}", s, dtype) for i, s in enumerate(shape_list)]
    lay = Layout(specs)
    c = Compressor(lay, density=density, tile=tile, index_coding=coding, table=table, beta=0.5)
    for r in range(2):
        ds = [make(s.shape, pattern, dtype, seed + 7 * r + i) for i, s in enumerate(specs)]
        before = [e.clone() for e in c.error] if c.error else [torch.zeros(s.numel) for s in specs]
        f = decode_frame(c.compress(ds, round=r, sender=0), lay)
        for j, (spec, e0, e1, d, u) in enumerate(zip(specs, before, c.error, ds, f.to_dense(), strict=False)):
            g = ChunkGrid.of(spec.shape, tile)
            want_kept = sum(kept_per_chunk(n, c.k, tile * tile) for n in g.chunk_sizes())
            assert len(f.indices[j]) == want_kept
            assert len(torch.unique(f.indices[j])) == want_kept
            assert u.shape == spec.shape and u.dtype == torch.float32
            pre = e0 * torch.tensor(0.5) + d.reshape(-1).float()
            assert torch.isfinite(u).all()
            kept = torch.zeros(spec.numel, dtype=torch.bool)
            kept[f.indices[j]] = True
            assert torch.equal(e1[~kept], pre[~kept])
            assert torch.equal(e1[kept], pre[kept] - u.reshape(-1)[kept])
            # the kept set is a top-k: nothing dropped is larger than anything kept in its chunk
            if spec.numel:
                chunk = chunk_of(g)
                values = pre.abs()
                inf = torch.full((g.n_chunks,), torch.inf)
                kept_min = inf.scatter_reduce(0, chunk[kept], values[kept], "amin")
                dropped_max = (-inf).scatter_reduce(0, chunk[~kept], values[~kept], "amax")
                assert (dropped_max <= kept_min).all(), spec
        params = [torch.zeros(s.shape, dtype=s.dtype) for s in specs]
        apply_frames(params, [f])


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba not installed")
@given(st.lists(shapes, min_size=1, max_size=3), st.sampled_from([1, 2, 4, 5, 8, 16, 64]),
       st.floats(0.001, 1.0), patterns, dtypes, st.sampled_from(["rice", "fixed"]),
       st.sampled_from(["chunk", "tensor"]), st.integers(0, 2**16))
def test_kernel_matches_torch_bit_for_bit(shape_list, tile, density, pattern, dtype, coding, table, seed):
    specs = [TensorSpec(f"t{i}", s, dtype) for i, s in enumerate(shape_list)]
    lay = Layout(specs)
    kw = dict(density=density, tile=tile, index_coding=coding, table=table, beta=0.95)
    a, b = Compressor(lay, backend="numba", **kw), Compressor(lay, backend="reference", **kw)
    for r in range(3):
        ds = [make(s.shape, pattern, dtype, seed + 7 * r + i) for i, s in enumerate(specs)]
        assert a.compress(ds, round=r, sender=3) == b.compress(ds, round=r, sender=3)
        assert all(torch.equal(x, y) for x, y in zip(a.error, b.error, strict=False))
