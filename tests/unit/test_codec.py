"""Behaviour of the SparseLoCo codec: selection, quantizer, error feedback, frames, apply."""

import re
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from geoloco.compression import (
    Compressor,
    FrameError,
    Layout,
    TensorSpec,
    aggregate,
    apply_frames,
    codec_threads,
    decode_apply,
    decode_frame,
    encode_dense,
    on_huge_pages,
    set_codec_threads,
)
from geoloco.compression.format import (
    DENSE_DTYPE_CODES,
    HEADER_BYTES,
    INDEX_RICE,
    KIND_DENSE,
    KIND_SPARSE,
    TABLE_PER_CHUNK,
    dense_frame_bytes,
    read_sections,
    write_frame,
)
from geoloco.compression.frame import encode_dense_buffer
from geoloco.compression.layout import frame_geometry
from geoloco.compression.registry import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
SPECS = [
    TensorSpec("w", (130, 200), torch.float32),
    TensorSpec("b", (77,), torch.float32),
    TensorSpec("s", (), torch.float32),
    TensorSpec("empty", (0, 5), torch.float32),
    TensorSpec("conv", (3, 4, 5), torch.float32),
    TensorSpec("tall", (200, 64), torch.bfloat16),
]
LAYOUT = Layout(SPECS)


def deltas(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.shape, generator=g) * scale for s in SPECS]


def test_layout_digest_depends_on_names_shapes_dtypes():
    base = Layout(SPECS).digest
    assert Layout(list(SPECS)).digest == base
    renamed = [TensorSpec("w2", (130, 200), torch.float32)] + SPECS[1:]
    reshaped = [TensorSpec("w", (200, 130), torch.float32)] + SPECS[1:]
    retyped = [TensorSpec("w", (130, 200), torch.bfloat16)] + SPECS[1:]
    assert len({base, Layout(renamed).digest, Layout(reshaped).digest, Layout(retyped).digest}) == 4


def test_from_named_tensors():
    m = torch.nn.Linear(3, 2)
    lay = Layout.from_named_tensors(m.named_parameters())
    assert [s.name for s in lay.specs] == ["weight", "bias"]
    assert lay.numel == 8


@pytest.mark.slow
@pytest.mark.parametrize("table", ["chunk", "tensor"])
@pytest.mark.parametrize("coding", ["rice", "fixed"])
def test_decoded_equals_what_error_feedback_removed(table, coding):
    c = Compressor(LAYOUT, density=1 / 32, tile=16, table=table, index_coding=coding, beta=0.9)
    for r in range(3):
        before = [e.clone() for e in c.error] if c.error else [torch.zeros(s.numel) for s in SPECS]
        ds = deltas(r)
        frame = decode_frame(c.compress(ds, round=r, sender=7), LAYOUT)
        assert (frame.kind, frame.round, frame.sender) == ("sparse", r, 7)
        for spec, e0, e1, d, u in zip(SPECS, before, c.error, ds, frame.to_dense(), strict=False):
            pre = e0 * torch.tensor(0.9) + d.reshape(-1).float()
            kept = torch.zeros(spec.numel, dtype=torch.bool)
            kept[frame.indices[SPECS.index(spec)]] = True
            assert torch.equal(e1[~kept], pre[~kept])
            torch.testing.assert_close(e1[kept] + u.reshape(-1)[kept], pre[kept], rtol=0, atol=1e-6)


def test_keeps_exact_topk_per_tile_with_lower_index_tiebreak():
    lay = Layout([TensorSpec("m", (8, 8), torch.float32)])
    x = torch.zeros(8, 8)
    x[0, :4] = torch.tensor([1.0, -3.0, 3.0, 2.0])  # tile (0,0) of 4x4: ties between 1 and 2
    x[1, 0] = -3.0
    c = Compressor(lay, density=2 / 16, tile=4, beta=0.0)
    f = decode_frame(c.compress([x], round=0, sender=0), lay)
    idx = f.indices[0]
    first_tile = sorted(i for i in idx.tolist() if i % 8 < 4 and i // 8 < 4)
    assert first_tile == [1, 2]  # |-3| at 1 and |3| at 2 beat |-3| at 8 (higher index)


def test_per_chunk_k_and_leftover_chunks():
    lay = Layout([TensorSpec("m", (70, 130), torch.float32)])
    c = Compressor(lay, density=64 / 4096, tile=64)
    f = decode_frame(c.compress([torch.randn(70, 130)], round=0, sender=0), lay)
    # 2 full tiles (64x128 region) keep 64 each; 9100 - 8192 = 908 leftovers keep ceil(64*908/4096) = 15
    assert len(f.indices[0]) == 2 * 64 + 15
    assert len(torch.unique(f.indices[0])) == len(f.indices[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_delta_raises_before_state_changes(bad):
    c = Compressor(LAYOUT, density=1 / 16, tile=16)
    c.compress(deltas(0), round=0, sender=0)
    state = [e.clone() for e in c.error]
    ds = deltas(1)
    ds[1][5] = bad
    with pytest.raises(ValueError, match="'b'"):
        c.compress(ds, round=1, sender=0)
    assert all(torch.equal(a, b) for a, b in zip(state, c.error, strict=False))


def test_error_feedback_overflow_raises_and_keeps_the_state():
    """Finite deltas whose error feedback overflows to Inf are refused too; on the CPU the
    state is left as it was (the new error feedback goes to spare buffers)."""
    c = Compressor(LAYOUT, density=1 / 16, tile=16)
    huge = [torch.full(s.shape, 3e38) for s in SPECS]
    c.compress(huge, round=0, sender=0)  # e ~ 3e38 minus what was sent
    state = [e.clone() for e in c.error]
    with pytest.raises(ValueError, match="error feedback for 'w' overflowed to Inf"):
        c.compress(huge, round=1, sender=0)
    assert all(torch.equal(a, b) for a, b in zip(state, c.error, strict=True))
    c.compress(deltas(1), round=1, sender=0)  # and it goes on


def test_wrong_shapes_or_count_raise():
    c = Compressor(LAYOUT)
    with pytest.raises(ValueError, match="expected 6 tensors"):
        c.compress(deltas()[:-1], round=0, sender=0)
    ds = deltas()
    ds[0] = torch.randn(3, 3)
    with pytest.raises(ValueError, match="'w'"):
        c.compress(ds, round=0, sender=0)


def test_state_dict_roundtrip_continues_identically():
    a = Compressor(LAYOUT, density=1 / 16, tile=16)
    a.compress(deltas(0), round=0, sender=0)
    b = Compressor(LAYOUT, density=1 / 16, tile=16)
    b.load_state_dict(a.state_dict())
    assert a.compress(deltas(1), round=1, sender=0) == b.compress(deltas(1), round=1, sender=0)


def test_other_layout_is_named():
    frame = Compressor(LAYOUT).compress(deltas(), round=0, sender=0)
    other = Layout([TensorSpec("x", (3,), torch.float32)])
    with pytest.raises(FrameError, match="another layout.*1 tensors|another layout"):
        decode_frame(frame, other)
    renamed = Layout([TensorSpec("w_renamed", (130, 200), torch.float32)] + SPECS[1:])
    with pytest.raises(FrameError, match="digest"):
        decode_frame(frame, renamed)


def test_damaged_frames_raise_frame_error():
    frame = Compressor(LAYOUT, density=1 / 16, tile=16).compress(deltas(), round=0, sender=0)
    with pytest.raises(FrameError, match="truncated"):
        decode_frame(frame[:-1], LAYOUT)
    with pytest.raises(FrameError, match="truncated"):
        decode_frame(frame[:10], LAYOUT)
    with pytest.raises(FrameError, match="trailing"):
        decode_frame(frame + frame, LAYOUT)
    with pytest.raises(FrameError, match="trailing"):
        decode_frame(frame + b"\0" * 1000, LAYOUT)
    flipped = bytearray(frame)
    flipped[len(frame) // 2] ^= 0x10
    with pytest.raises(FrameError, match="checksum"):
        decode_frame(bytes(flipped), LAYOUT)
    with pytest.raises(FrameError, match="magic"):
        decode_frame(b"XXXX" + frame[4:], LAYOUT)
    with pytest.raises(FrameError):
        decode_frame(b"", LAYOUT)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("zstd", [False, True])
def test_dense_frames_roundtrip(dtype, zstd):
    ds = deltas()
    f = decode_frame(encode_dense(LAYOUT, ds, round=4, sender=2, dtype=dtype, zstd=zstd), LAYOUT)
    assert f.kind == "dense" and f.round == 4 and f.sender == 2
    for d, u in zip(ds, f.to_dense(), strict=False):
        want = d.to(torch.bfloat16).float() if dtype == "bf16" else d.float()
        assert torch.equal(u, want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("zstd", [False, True])
def test_a_dense_frame_written_in_place_is_the_formats_bytes(dtype, zstd):
    """encode_dense (and encode_dense_buffer, the coordinator's state frame) fills one buffer
    in place: the bytes are write_frame's of the tensors' bytes joined, and its size
    dense_frame_bytes, without zstd."""
    ds = deltas()
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    raw = b"".join(d.reshape(-1).to(tdtype).contiguous().view(torch.int16 if dtype == "bf16" else torch.int32)
                   .numpy().tobytes() for d in ds)
    want = write_frame(KIND_DENSE, DENSE_DTYPE_CODES[dtype], 0, LAYOUT, 4, 2, 0, 0, [raw], zstd)
    assert encode_dense(LAYOUT, ds, round=4, sender=2, dtype=dtype, zstd=zstd) == want
    if not zstd:
        assert encode_dense_buffer(LAYOUT, ds, round=4, sender=2, dtype=dtype) == want
        assert dense_frame_bytes(LAYOUT, dtype) == len(want)


def test_zstd_sparse_frames_decode_to_the_same_update():
    a = Compressor(LAYOUT, density=1 / 16, tile=16, zstd=False).compress(deltas(), round=0, sender=0)
    b = Compressor(LAYOUT, density=1 / 16, tile=16, zstd=True).compress(deltas(), round=0, sender=0)
    fa, fb = decode_frame(a, LAYOUT), decode_frame(b, LAYOUT)
    assert all(torch.equal(x, y) for x, y in zip(fa.to_dense(), fb.to_dense(), strict=False))


def _frames(n, seed=0):
    out = []
    for i in range(n):
        c = Compressor(LAYOUT, density=1 / 16, tile=16)
        out.append(decode_frame(c.compress(deltas(seed + i), round=0, sender=i), LAYOUT))
    return out


def test_aggregate_sum_and_mean_kept():
    frames = _frames(3)
    dense = [f.to_dense() for f in frames]
    w = [0.5, 2.0, -1.0]
    s = aggregate(LAYOUT, frames, w, mode="sum")
    for j in range(len(SPECS)):
        want = sum(wi * d[j] for wi, d in zip(w, dense, strict=False))
        torch.testing.assert_close(s[j], want)
    m = aggregate(LAYOUT, frames, mode="mean_kept")
    for j, spec in enumerate(SPECS):
        cnt = torch.zeros(spec.numel)
        for f in frames:
            cnt[f.indices[j]] += 1
        want = sum(d[j].reshape(-1) for d in dense) / cnt.clamp(min=1)
        torch.testing.assert_close(m[j].reshape(-1), want)


def _index_add_aggregate(frames, w, mode):
    """The aggregate the module documents, one index_add_ per frame from zero in frame
    order, fp32(w x v), the mean over keepers divided in fp32: independent of the fused
    multi-frame kernels that ``aggregate`` and ``apply_frames`` run on the CPU."""
    out = []
    for j, spec in enumerate(SPECS):
        u, cnt = torch.zeros(spec.numel), torch.zeros(spec.numel)
        for f, wi in zip(frames, w, strict=True):
            u.index_add_(0, f.indices[j], f.values[j] * torch.tensor(wi, dtype=torch.float32))
            cnt.index_add_(0, f.indices[j], torch.ones(len(f.indices[j])))
        if mode == "mean_kept":
            u = torch.where(cnt > 0, u / cnt.clamp(min=1.0), u)
        out.append(u.view(spec.shape))
    return out


@pytest.mark.parametrize("mode", ["sum", "mean_kept"])
@pytest.mark.parametrize("n_frames", [1, 3, 8])
def test_aggregate_is_the_index_add_aggregate_bit_for_bit(mode, n_frames):
    """The fused aggregate (the coordinator's ``aggregate`` broadcast compresses it) gives
    the same bits as frame-by-frame index_add_, overlapping keeps and mixed weights included."""
    frames = _frames(n_frames)
    w = [0.7, -1.25, 0.1, 2.0, 0.5, 1.0, 0.3, 0.9][:n_frames]
    got = aggregate(LAYOUT, frames, w, mode=mode)
    assert all(f._indices is None for f in frames)  # fused: no index tensors were made
    for g, want in zip(got, _index_add_aggregate(frames, w, mode), strict=True):
        assert g.dtype == torch.float32 and g.shape == want.shape
        assert torch.equal(g, want)


@pytest.mark.parametrize("mode", ["sum", "mean_kept"])
@pytest.mark.parametrize("n_frames", [1, 3])
def test_apply_equals_adding_the_aggregate(mode, n_frames):
    frames = _frames(n_frames)
    w = [0.7] * n_frames
    params = [torch.randn(s.shape).to(s.dtype) for s in SPECS]
    want = [(p.float() + torch.tensor(0.5) * u).to(p.dtype)
            for p, u in zip(params, _index_add_aggregate(frames, w, mode), strict=False)]
    apply_frames(params, frames, w, mode=mode, alpha=0.5)
    for p, q in zip(params, want, strict=False):
        assert torch.equal(p, q)


def test_dense_and_sparse_frames_mix():
    frames = _frames(2)
    ds = [torch.ones(s.shape) for s in SPECS]
    frames.append(decode_frame(encode_dense(LAYOUT, ds, round=0, sender=9), LAYOUT))
    m = aggregate(LAYOUT, frames, mode="mean_kept")
    j = 0
    kept = torch.zeros(SPECS[j].numel)
    total = torch.zeros(SPECS[j].numel)
    for f in frames[:2]:
        kept[f.indices[j]] += 1
        total[f.indices[j]] += f.values[j]
    want = (total + 1.0) / (kept + 1)
    torch.testing.assert_close(m[j].reshape(-1), want)
    params = [torch.zeros(s.shape) for s in SPECS]
    apply_frames(params, frames, mode="mean_kept")
    assert all(torch.equal(p, u) for p, u in zip(params, m, strict=False))


def test_apply_touches_only_kept_coordinates():
    (f,) = _frames(1)
    params = [torch.zeros(s.shape).to(s.dtype) for s in SPECS]
    apply_frames(params, [f])
    for j, p in enumerate(params):
        nz = p.reshape(-1).float().nonzero().reshape(-1)
        assert set(nz.tolist()) <= set(f.indices[j].tolist())


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba not installed")
def test_kernel_and_torch_paths_give_identical_bytes_and_state():
    for table in ("chunk", "tensor"):
        for coding in ("rice", "fixed"):
            a = Compressor(LAYOUT, density=3 / 64, tile=8, table=table, index_coding=coding, backend="numba")
            b = Compressor(LAYOUT, density=3 / 64, tile=8, table=table, index_coding=coding, backend="reference")
            for r in range(3):
                ds = deltas(r)
                assert a.compress(ds, round=r, sender=1) == b.compress(ds, round=r, sender=1)
                assert all(torch.equal(x, y) for x, y in zip(a.error, b.error, strict=False))


def test_apply_to_module_parameters_in_place():
    m = torch.nn.Linear(40, 30)
    lay = Layout.from_named_tensors(m.named_parameters())
    before = [p.detach().clone() for p in m.parameters()]
    c = Compressor(lay, density=1 / 8, tile=8)
    f = decode_frame(c.compress([torch.randn_like(p) for p in m.parameters()], round=0, sender=0), lay)
    apply_frames(list(m.parameters()), [f], alpha=-1.0)
    for p, b, u in zip(m.parameters(), before, f.to_dense(), strict=True):
        assert torch.equal(p.detach(), b - u)


@pytest.mark.slow  # a python process that imports torch
def test_codec_without_numba_gives_the_same_bytes_and_values(tmp_path):
    """Where numba is missing, the torch reference encodes and decodes: a process that
    cannot import numba makes the same frame and decodes it the same way."""
    if "numba" not in BACKENDS:
        pytest.skip("numba not installed: this process already runs the fallback")
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["numba"] = None  # import numba -> ImportError
        warnings.simplefilter("ignore")
        import torch
        from geoloco.compression import Compressor, Layout, TensorSpec, decode_frame
        from geoloco.compression.registry import BACKENDS
        assert list(BACKENDS) == ["reference"]
        torch.manual_seed(3)
        lay = Layout([TensorSpec("m", (40, 24), torch.float32), TensorSpec("v", (9,), torch.float32)])
        data = Compressor(lay, density=1 / 8, tile=8).compress([torch.randn(40, 24), torch.randn(9)],
                                                              round=0, sender=0)
        frame = decode_frame(data, lay)
        torch.save({"data": data, "dense": frame.to_dense()}, sys.argv[1])
    """)
    out = tmp_path / "fallback.pt"
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, cwd=ROOT, timeout=300)
    plain = torch.load(out)
    torch.manual_seed(3)
    lay = Layout([TensorSpec("m", (40, 24), torch.float32), TensorSpec("v", (9,), torch.float32)])
    data = Compressor(lay, density=1 / 8, tile=8).compress([torch.randn(40, 24), torch.randn(9)],
                                                          round=0, sender=0)
    assert plain["data"] == data
    for a, b in zip(decode_frame(data, lay).to_dense(), plain["dense"], strict=True):
        assert torch.equal(a, b)

def _with_crc(frame: bytearray) -> bytes:
    """A frame whose checksum is recomputed after a deliberate change."""
    frame[-4:] = zlib.crc32(bytes(frame[:-4])).to_bytes(4, "little")
    return bytes(frame)


def test_index_offsets_are_validated():
    """Segments of 64 chunks are decoded in parallel from the offsets section (the last
    one); offsets that disagree with the index stream are refused."""
    lay = Layout([TensorSpec("w", (256, 256), torch.float32)])  # 256 chunks: 4 segments
    frame = Compressor(lay, density=1 / 16, tile=16).compress([torch.randn(256, 256)], round=0, sender=0)
    offs = np.frombuffer(frame[-4 - 16:-4], dtype="<u4").copy()
    assert offs[0] == 0 and (np.diff(offs) > 0).all()

    def with_offsets(values) -> bytes:
        out = bytearray(frame)
        out[-4 - 16:-4] = np.asarray(values, dtype="<u4").tobytes()
        return _with_crc(out)

    decode_frame(with_offsets(offs), lay)
    with pytest.raises(FrameError, match="start at 5"):
        decode_frame(with_offsets([5, *offs[1:]]), lay)
    with pytest.raises(FrameError, match="segment 0 do not end"):
        decode_frame(with_offsets([0, offs[1] + 1, *offs[2:]]), lay)
    with pytest.raises(FrameError, match="segment 3 .* lies beyond the index section"):
        decode_frame(with_offsets([*offs[:3], 2**31]), lay)
    with pytest.raises(FrameError, match="segment 2 .* lies before segment 1"):
        decode_frame(with_offsets([0, offs[2], offs[1], offs[3]]), lay)


def test_index_section_with_bytes_past_the_last_chunk_is_refused():
    """A Rice index section may be shorter than its maximum; bytes after the last chunk's
    codes (the last segment has fewer than 64 chunks here) are a FrameError, not a crash."""
    lay = Layout([TensorSpec("w", (200, 256), torch.float32)])  # 200 chunks of 16x16: segments of 64, 64, 64, 8
    data = Compressor(lay, density=1 / 16, tile=16).compress([torch.randn(200, 256)], round=0, sender=0)
    geo = frame_geometry(lay, 16, 16, True, False)
    table, codes, index, offsets = read_sections(
        memoryview(data)[HEADER_BYTES:-4],
        [("table", geo.table_bytes, True), ("codes", geo.code_bytes, True), ("index", geo.index_bytes_max, False),
         ("index offsets", 4 * len(geo.seg_start), True)])
    longer = write_frame(KIND_SPARSE, TABLE_PER_CHUNK, INDEX_RICE, lay, 0, 0, 16, 16,
                         [table, codes, bytes(index) + b"\0", offsets], False)
    with pytest.raises(FrameError, match="'w': the indices of segment 3 do not end"):
        decode_frame(longer, lay)
    params = [torch.zeros(200, 256)]
    with pytest.raises(FrameError, match="segment 3 do not end"):
        decode_apply(params, longer, lay)
    assert not params[0].any()


@pytest.mark.parametrize("huge", [False, True])
def test_single_frame_apply_matches_the_aggregate_bit_for_bit(huge):
    """One sparse frame into fp32 CPU params is applied straight from its sections (no
    index arrays); it must give the general path's bits, on huge pages too."""
    lay = Layout([TensorSpec("a", (300, 130), torch.float32), TensorSpec("b", (77,), torch.float32),
                  TensorSpec("c", (64, 64), torch.float32), TensorSpec("s", (), torch.float32)])
    frame = Compressor(lay, density=1 / 8, tile=16).compress(
        [torch.randn(s.shape) for s in lay.specs], round=0, sender=0)
    f = decode_frame(frame, lay)
    start = [torch.randn(s.shape) for s in lay.specs]
    params = on_huge_pages(start) if huge else [p.clone() for p in start]
    apply_frames(params, [f], [0.7], alpha=0.3)
    assert f._indices is None  # applied without materializing indices and values
    want = [p + torch.tensor(0.3) * u for p, u in zip(start, aggregate(lay, [f], [0.7]), strict=True)]
    for p, q in zip(params, want, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kw", [{}, {"table": "tensor"}, {"index_coding": "fixed"}, {"tile": 8}])
def test_decode_apply_matches_decode_then_apply(kw):
    """decode_apply validates and adds in one pass: same bits as decode_frame +
    apply_frames, on fp32 CPU params and (through the general path) bf16 ones."""
    frame = Compressor(LAYOUT, density=1 / 8, **kw).compress(deltas(3), round=0, sender=0)
    for dtype in (torch.float32, torch.bfloat16):
        start = [torch.randn(s.shape).to(dtype) for s in SPECS]
        want = [p.clone() for p in start]
        apply_frames(want, [decode_frame(frame, LAYOUT)], [0.7], alpha=0.3)
        got = [p.clone() for p in start]
        f = decode_apply(got, frame, LAYOUT, weight=0.7, alpha=0.3)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ref = decode_frame(frame, LAYOUT)
        assert all(torch.equal(a, b) for a, b in zip(f.indices, ref.indices, strict=True))


def test_decode_apply_puts_everything_back_when_a_later_chunk_is_bad():
    """Chunks are added as they check out; a problem found after some were added (in the
    last chunk, or at the segment's end) must leave the params bit for bit as before, and
    raise the error decode_frame raises."""
    lay = Layout([TensorSpec("w", (512, 512), torch.float32)])  # 64 chunks: one segment
    g = torch.Generator().manual_seed(0)  # the count below depends on the data: fixed data
    frame = Compressor(lay).compress([torch.randn(512, 512, generator=g)], round=0, sender=0)
    start = on_huge_pages([torch.randn(512, 512, generator=g)])
    late = 0
    for off in range(len(frame) - 5, len(frame) - 60, -1):  # the index section's last bytes
        bad = bytearray(frame)
        bad[off] ^= 0xA5
        bad = _with_crc(bad)
        try:
            decode_frame(bad, lay)
        except FrameError as exc:
            message = str(exc)
        else:
            continue
        if not re.search(r"chunk 63|segment 0 do not end", message):
            continue
        params = [p.clone() for p in start]
        with pytest.raises(FrameError) as caught:
            decode_apply(params, bad, lay)
        assert str(caught.value) == message
        assert torch.equal(params[0], start[0])
        late += 1
    assert late >= 5
    # the checksum is checked beside the decoding: a frame that decodes but does not match
    # its checksum is added in, then put back
    corrupt = bytearray(frame)
    corrupt[len(frame) // 2] ^= 0x01
    params = [p.clone() for p in start]
    with pytest.raises(FrameError, match="checksum mismatch"):
        decode_apply(params, bytes(corrupt), lay)
    assert torch.equal(params[0], start[0])


def test_on_huge_pages_copies_values_and_shapes():
    ts = [torch.randn(1000, 700), torch.randn(5), torch.zeros(0), torch.randn(3, 4).to(torch.bfloat16)]
    out = on_huge_pages(ts)
    for a, b in zip(ts, out, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    out[0].add_(1.0)
    assert not torch.equal(out[0], ts[0])  # a copy, not a view of the input


def test_the_codec_thread_count_is_its_own_setting():
    """set_codec_threads sets the codec's threads apart from torch's (the coordinator gives
    torch one and the codec the cores); None follows torch's again. The frames and the
    applied bits do not depend on it."""
    threads = torch.get_num_threads()
    frames = _frames(3)
    results = []
    try:
        for codec in (None, 2, 1):
            set_codec_threads(codec)
            torch.set_num_threads(1)
            assert codec_threads() == (codec or 1)
            params = [torch.zeros(s.shape) for s in SPECS]
            apply_frames(params, frames, mode="mean_kept", alpha=-0.5)
            results.append(params)
        with pytest.raises(ValueError, match="at least 1"):
            set_codec_threads(0)
    finally:
        set_codec_threads(None)
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r, results[0], strict=True))
