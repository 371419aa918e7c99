"""Every codec backend in the registry meets the codec's definition (docs/codec.md,
"Algorithm"), and every other backend matches the torch reference: the same frame bytes
and error feedback round after round, the same indices and values whichever backend
decodes, the same parameters after decode_apply and after several frames at once, and the same errors for bad deltas and
bad frames.

Shapes include bands wider than the numba encoder's 4096-column work units (GROUP_COLS),
ragged right and bottom strips, flat tensors, 0-d and empty ones."""

import math
import random
import zlib

import numpy as np
import pytest
import torch

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
from geoloco.compression.format import HEADER_BYTES, read_header, read_sparse
from geoloco.compression.layout import ChunkGrid
from geoloco.compression.registry import BACKENDS

NAMES = list(BACKENDS)
OTHERS = [n for n in BACKENDS if n != "reference"]  # compared with the reference
GROUP_COLS = 4096  # columns of tiles in one work unit of the numba encoder
if "numba" in BACKENDS:
    from geoloco.compression._cpu.encode_kernels import GROUP_COLS
WIDE = GROUP_COLS + 69  # two work units per band of tiles, and a right strip


def values(shape: tuple, pattern: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if pattern == "normal":
        x = torch.randn(n, generator=g)
    elif pattern == "row-scaled":  # like real pseudo-gradients: each row its own scale
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2).sort().values
    elif pattern == "ties":
        x = torch.randint(-2, 3, (n,), generator=g).float()
    elif pattern == "zeros":
        x = torch.zeros(n)
    elif pattern == "tiny":  # denormals
        x = torch.randint(-5, 6, (n,), generator=g).float() * 1e-40
    else:  # "huge range": magnitudes from 2**-60 to 2**60
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    return x.reshape(shape)


# (shapes, tile, density, pattern): a few large cases, many small ones
CASES = [
    ([(131, WIDE)], 64, 64 / 4096, "row-scaled"),
    ([(64, 2 * GROUP_COLS)], 64, 1 / 4096, "normal"),
    ([(70, WIDE), (WIDE,)], 8, 1 / 64, "huge range"),
    ([(9, 300), (301,), (), (0,), (0, 7), (4, 0)], 3, 0.3, "normal"),
    ([(100, 250), (3, 5, 7), (1, 1)], 100, 1 / 4096, "normal"),
    ([(200, 130), (99, 100)], 100, 0.05, "ties"),
    ([(64, 64), (65, 63), (4100, 3)], 64, 1.0, "normal"),
    ([(24, 40), (17,), ()], 8, 1.0, "ties"),
    ([(130, 200), (77,)], 8, 3 / 64, "zeros"),
    ([(130, 200), (77,)], 16, 1 / 16, "tiny"),
    ([(33, 65), (5, 5, 5)], 4, 0.5, "huge range"),
]
CODECS = [("chunk", "rice"), ("tensor", "fixed"), ("chunk", "fixed"), ("tensor", "rice"), ("bins", "rice"),
          ("bins", "fixed")]
ROUNDS = 3


def _case_id(case) -> str:
    shapes, tile, density, pattern = case
    return f"{len(shapes)}tensors-tile{tile}-k{max(1, round(density * tile * tile))}-{pattern.replace(' ', '')}"


def _layout(shapes) -> Layout:
    return Layout([TensorSpec(f"t{i}", s, torch.float32) for i, s in enumerate(shapes)])


def _frames(backend: str, case, table: str, coding: str) -> tuple[list[bytes], list[list[torch.Tensor]]]:
    """The frames and error feedback of ROUNDS compress calls of one backend."""
    shapes, tile, density, pattern = case
    comp = Compressor(_layout(shapes), density=density, tile=tile, table=table, index_coding=coding, beta=0.9,
                      backend=backend)
    frames, errors = [], []
    for r in range(ROUNDS):
        frames.append(comp.compress([values(s, pattern, 10 * r + i) for i, s in enumerate(shapes)], round=r, sender=2))
        errors.append([e.clone() for e in comp.error])
    return frames, errors


@pytest.fixture(scope="module")
def reference_runs() -> dict:
    """The reference's frames and error feedback, per (case, codec), made once."""
    return {}


def _reference(runs: dict, case, table: str, coding: str):
    key = (_case_id(case), table, coding)
    if key not in runs:
        runs[key] = _frames("reference", case, table, coding)
    return runs[key]


@pytest.mark.slow
@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_same_bytes_and_error_feedback_round_after_round(backend, case, reference_runs):
    for i, (table, coding) in enumerate(CODECS):
        if i and math.prod(case[0][0]) > 100_000:  # the large cases in the default codec only
            break
        want_frames, want_errors = _reference(reference_runs, case, table, coding)
        frames, errors = _frames(backend, case, table, coding)
        for r in range(ROUNDS):
            assert frames[r] == want_frames[r], f"{table}/{coding}: frame of round {r} differs"
            for a, b in zip(errors[r], want_errors[r], strict=True):
                assert torch.equal(a, b), f"{table}/{coding}: error feedback after round {r} differs"


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_backend_decodes_the_same_indices_and_values_as_the_reference(backend, case, reference_runs):
    layout = _layout(case[0])
    frames, _ = _reference(reference_runs, case, *CODECS[0])
    for data in frames:
        want = decode_frame(data, layout, backend="reference")
        got = decode_frame(data, layout, backend=backend)
        assert got.kept == want.kept == sum(len(i) for i in want.indices)
        for a, b, x, y in zip(got.indices, want.indices, got.values, want.values, strict=True):
            assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
            assert x.dtype == y.dtype == torch.float32 and torch.equal(x, y)


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kept_values_are_the_decoded_values_without_the_indices(backend, case, reference_runs):
    """What a frame's magnitudes (the coordinator's bounds) read: the values of
    ``materialize``, made from the codes and the table alone (the numba body decodes no
    positions for them, and takes its magnitudes from the codes and levels: its norm sums
    the same float64 squares in another order, so it is equal to within a few ulps of an
    exactly rounded sum, and the largest value is equal)."""
    layout = _layout(case[0])
    frames, _ = _reference(reference_runs, case, *CODECS[0])
    for data in frames:
        want = decode_frame(data, layout, backend="reference")
        got = decode_frame(data, layout, backend=backend)
        for x, y in zip(got.body.kept_values(), want.values, strict=True):
            assert x.dtype == y.dtype == torch.float32 and torch.equal(x, y)
        exact = math.sqrt(math.fsum(v * v for x in want.values for v in x.double().tolist()))
        largest = max((float(x.abs().max()) for x in want.values if x.numel()), default=0.0)
        for norm, big in (got.magnitudes(), want.magnitudes()):
            assert norm == pytest.approx(exact, rel=1e-12, abs=0.0) and big == largest
        assert not getattr(got.body, "ready", False)  # no positions were decoded


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("case", [CASES[3], CASES[7], CASES[10]], ids=_case_id)
def test_magnitudes_agree_in_every_table_and_index_coding(backend, case, reference_runs):
    """A frame's magnitudes from its codes and levels read each table mode's levels (per
    chunk, per tensor; 4-bin frames are the reference's own) and either index coding: on
    three small cases (empty and 0-d tensors, ties, magnitudes 2^+-60), as the other
    codecs' reference frames are slow to make at size."""
    layout = _layout(case[0])
    for table, coding in CODECS:
        frames, _ = _reference(reference_runs, case, table, coding)
        for data in frames:
            want = decode_frame(data, layout, backend="reference")
            norm, big = decode_frame(data, layout, backend=backend).magnitudes()
            exact = math.sqrt(math.fsum(v * v for x in want.values for v in x.double().tolist()))
            assert norm == pytest.approx(exact, rel=1e-12, abs=0.0), (table, coding)
            assert big == max((float(x.abs().max()) for x in want.values if x.numel()), default=0.0), (table, coding)


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("case", CASES[::3], ids=_case_id)
def test_decode_apply_adds_the_same_bits(backend, case, reference_runs):
    layout = _layout(case[0])
    frames, _ = _reference(reference_runs, case, *CODECS[0])
    start = [values(s.shape, "normal", 99) for s in layout.specs]
    want, got = [p.clone() for p in start], [p.clone() for p in start]
    for r, data in enumerate(frames):
        decode_apply(want, data, layout, weight=0.5 + r, alpha=-0.3, backend="reference")
        decode_apply(got, data, layout, weight=0.5 + r, alpha=-0.3, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("slab_bytes", [None, 1])
@pytest.mark.parametrize("case", CASES[::2], ids=_case_id)
def test_a_frame_applied_without_its_positions_adds_the_bits_of_one_that_kept_them(case, slab_bytes, reference_runs,
                                                                                     monkeypatch):
    """One frame applied on its own (the coordinator's own frames, mode ``sum``) decodes its
    positions a slab of segments at a time and keeps none (numba): the reference's bits,
    those of the same frame decoded with its positions kept, and the body holds no
    positions after. slab_bytes 1: a slab of the fewest segments, so a frame takes many."""
    if "numba" not in BACKENDS:
        pytest.skip("the numba backend is not installed")
    from geoloco.compression._cpu import decoder
    if slab_bytes is not None:
        monkeypatch.setattr(decoder, "SLAB_BYTES", slab_bytes)
    layout = _layout(case[0])
    frames, _ = _reference(reference_runs, case, *CODECS[0])
    start = [values(s.shape, "normal", 97) for s in layout.specs]
    bare, kept, want = ([p.clone() for p in start] for _ in range(3))
    for r, data in enumerate(frames):
        frame = decode_frame(data, layout, backend="numba")
        apply_frames(bare, [frame], [0.5 + r], alpha=-0.3)
        assert not frame.body.ready  # nothing decoded was kept
        apply_frames(kept, [decode_frame(data, layout, backend="numba", keep_positions=True)], [0.5 + r], alpha=-0.3)
        apply_frames(want, [decode_frame(data, layout, backend="reference")], [0.5 + r], alpha=-0.3)
    for a, b, c in zip(bare, kept, want, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)) and torch.equal(a.view(torch.int32),
                                                                                     c.view(torch.int32))


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("mode", ["sum", "mean_kept"])
@pytest.mark.parametrize("case", CASES[::2], ids=_case_id)
def test_several_frames_at_once_add_the_same_bits(backend, mode, case, reference_runs):
    """add_frames (apply_frames over several sparse frames) gives the reference's bits:
    per coordinate the frames that kept it added in frame order from zero, the mean
    divided in fp32 by their count (docs/codec.md, "Several frames at once"). The rounds
    of one compressor overlap in part; the first frame comes twice, once decoded by
    decode_apply (which keeps no positions), so some coordinates have every frame."""
    layout = _layout(case[0])
    frames, _ = _reference(reference_runs, case, *CODECS[0])
    start = [values(s.shape, "normal", 98) for s in layout.specs]
    weights = [0.5 + r for r in range(len(frames) + 1)]
    applied = decode_apply([p.clone() for p in start], frames[0], layout, backend=backend)
    got_frames = [decode_frame(d, layout, backend=backend) for d in frames] + [applied]
    want_frames = [decode_frame(d, layout, backend="reference") for d in frames + frames[:1]]
    want, got = [p.clone() for p in start], [p.clone() for p in start]
    assert BACKENDS["reference"].add_frames(layout, want, [f.body for f in want_frames], weights, mode, -0.3)
    assert BACKENDS[backend].add_frames(layout, got, [f.body for f in got_frames], weights, mode, -0.3)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want, strict=True))
    assert case[3] == "zeros" or any(not torch.equal(a, b) for a, b in zip(got, start, strict=True))
    apply_frames(got, got_frames, weights, mode=mode, alpha=-0.3)  # the entry point takes the same path
    BACKENDS["reference"].add_frames(layout, want, [f.body for f in want_frames], weights, mode, -0.3)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want, strict=True))


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba is not installed")
@pytest.mark.parametrize("slab_segments", [1, 3, 8])
@pytest.mark.parametrize("case", [CASES[2]], ids=_case_id)
def test_several_frames_at_once_slab_by_slab(slab_segments, case, reference_runs, monkeypatch):
    """A checked frame keeps no decoded positions: add_frames decodes them from the frame's
    bytes a slab of segments at a time. With slabs of 1, 3 and 8 of the 73 segments (the
    last slab shorter), and one frame that kept its positions when checked, the bits
    are the reference's."""
    from geoloco.compression._cpu import decoder

    layout = _layout(case[0])
    frames, _ = _reference(reference_runs, case, *CODECS[0])
    got_frames = [decode_frame(d, layout, backend="numba", keep_positions=i == 1) for i, d in enumerate(frames)]
    geo = got_frames[0].body.geometry
    assert len(geo.seg_start) > 2 * slab_segments  # several slabs
    assert [f.body.ready for f in got_frames] == [False, True, False]  # only the one asked to keeps positions
    assert len(got_frames[1].body.fa.positions) == geo.kept and len(got_frames[0].body.fa.positions) == 0
    seg_kept = int(np.diff(geo.seg_start[:, 2], append=geo.kept).max())
    monkeypatch.setattr(decoder, "SLAB_BYTES", 2 * seg_kept * 2 * slab_segments)  # two frames decode
    want_frames = [decode_frame(d, layout, backend="reference") for d in frames]
    start = [values(s.shape, "normal", 97) for s in layout.specs]
    weights = [0.5 + r for r in range(len(frames))]
    for mode in ("sum", "mean_kept"):
        want, got = [p.clone() for p in start], [p.clone() for p in start]
        assert BACKENDS["reference"].add_frames(layout, want, [f.body for f in want_frames], weights, mode, -0.3)
        assert BACKENDS["numba"].add_frames(layout, got, [f.body for f in got_frames], weights, mode, -0.3)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want, strict=True))
    assert [f.body.ready for f in got_frames] == [False, True, False]  # the slabs kept nothing


@pytest.mark.parametrize("backend", OTHERS)
def test_several_frames_of_other_codec_parameters_take_the_reference(backend):
    """Frames of different tiles or table modes are not added in one pass by the numba
    kernel (its chunks must be the same in every frame): add_frames declines, and
    apply_frames gives the reference's bits. Different index codings it takes."""
    shapes = [(70, 90), (33,)]
    layout = _layout(shapes)
    deltas = [values(s, "normal", 5) for s in shapes]
    frames = [decode_frame(Compressor(layout, density=0.1, tile=t, table=table, backend=backend).compress(
        deltas, round=0, sender=0), layout, backend=backend) for t, table in ((8, "chunk"), (8, "tensor"), (16, "chunk"))]
    start = [values(s, "normal", 6) for s in shapes]
    want, got = [p.clone() for p in start], [p.clone() for p in start]
    assert not BACKENDS[backend].add_frames(layout, got, [f.body for f in frames], [1.0] * 3, "mean_kept", 1.0)
    apply_frames(got, frames, mode="mean_kept")
    BACKENDS["reference"].add_frames(layout, want, [f.body for f in frames], [1.0] * 3, "mean_kept", 1.0)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    mixed = [decode_frame(Compressor(layout, density=0.1, tile=8, index_coding=coding, backend=backend).compress(
        deltas, round=0, sender=0), layout, backend=backend) for coding in ("rice", "fixed")]
    want, got = [p.clone() for p in start], [p.clone() for p in start]  # index codings mix: positions are positions
    assert BACKENDS[backend].add_frames(layout, got, [f.body for f in mixed], [0.5, 2.0], "mean_kept", 1.0)
    BACKENDS["reference"].add_frames(layout, want, [f.body for f in mixed], [0.5, 2.0], "mean_kept", 1.0)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("case", [c for c in CASES if math.prod(c[0][0]) <= 100_000], ids=_case_id)
def test_frames_meet_the_definition(backend, case):
    """Decoded, a frame holds per chunk exactly the top-k of the error feedback (equal
    magnitudes to the lower position), each as sign x hi or lo, the levels the bfloat16
    order statistics of the kept magnitudes; and the error feedback keeps the rest."""
    shapes, tile, density, pattern = case
    layout = _layout(shapes)
    for table, coding in CODECS[:2]:
        comp = Compressor(layout, density=density, tile=tile, table=table, index_coding=coding, beta=0.9,
                          backend=backend)
        before = [torch.zeros(s.numel) for s in layout.specs]
        for r in range(2):
            deltas = [values(s, pattern, 10 * r + i) for i, s in enumerate(shapes)]
            frame = decode_frame(comp.compress(deltas, round=r, sender=0), layout, backend=backend)
            for j, spec in enumerate(layout.specs):
                pre = before[j] * torch.tensor(0.9) + deltas[j].reshape(-1)
                _check_tensor(ChunkGrid.of(spec.shape, tile), comp.k, table == "chunk", pre, frame.indices[j],
                              frame.values[j], comp.error[j])
            before = [e.clone() for e in comp.error]


def _check_tensor(g: ChunkGrid, k_full: int, per_chunk: bool, pre, indices, vals, after) -> None:
    kept = torch.zeros(g.numel, dtype=torch.bool)
    kept[indices] = True
    assert len(indices) == int(kept.sum()), "an index repeats"
    assert torch.equal(after[~kept], pre[~kept]), "the error feedback changed where nothing was kept"
    assert torch.equal(after[indices], pre[indices] - vals), "the residual is not e - decoded"
    groups, at = [], 0
    for c, n in enumerate(g.chunk_sizes()):
        flat = g.flat_index(torch.full((n,), c), torch.arange(n))
        k = min(n, -(-k_full * n // g.size))
        order = sorted(range(n), key=lambda p: (-abs(float(pre[flat[p]])), p))  # the definition, literally
        want = flat[sorted(order[:k])]
        assert torch.equal(indices[at:at + k], want), f"chunk {c}: not its top-k"
        groups.append((want, vals[at:at + k]))
        at += k
    if per_chunk:
        for want, v in groups:
            _check_levels(pre[want], v)
    elif groups:
        _check_levels(pre[torch.cat([w for w, _ in groups])], torch.cat([v for _, v in groups]))


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("case", [c for c in CASES if math.prod(c[0][0]) <= 100_000], ids=_case_id)
def test_bins_frames_meet_the_reference_quantizer(backend, case):
    """With table="bins": per chunk the top-k as above; per tensor, each kept value codes
    as its bin round(centred / (6 sigma / 4) + 2) clamped to 0..3 (centred on the mean,
    sigma = |centred| / sqrt(k - 1)) and decodes as its bin's mean, recomputed here in
    float64 (codes within 1e-4 of a bin edge, where fp32 rounding decides, are skipped)."""
    shapes, tile, density, pattern = case
    if pattern in ("tiny", "huge range"):  # fp32 sums of these differ from float64 ones beyond any tolerance
        pytest.skip("float64 recomputation does not apply")
    layout = _layout(shapes)
    comp = Compressor(layout, density=density, tile=tile, table="bins", beta=0.9, backend=backend)
    deltas = [values(s, pattern, i) for i, s in enumerate(shapes)]
    frame = decode_frame(comp.compress(deltas, round=0, sender=0), layout, backend=backend)
    for j, spec in enumerate(layout.specs):
        if not spec.numel:
            continue
        pre = deltas[j].reshape(-1)
        _check_topk(ChunkGrid.of(spec.shape, tile), comp.k, pre, frame.indices[j])
        x = pre[frame.indices[j]].double()
        c = x - x.mean()
        std = c.norm() / math.sqrt(len(x) - 1) if len(x) > 1 else torch.tensor(math.inf)
        scale = 6 * std / 4 if 0 < float(std) < math.inf else torch.tensor(1.0, dtype=torch.float64)
        raw = c / scale + 2
        q = raw.round().clamp(0, 3)
        sure = (raw - raw.floor() - 0.5).abs() > 1e-4
        table = sorted(set(frame.values[j].tolist()))
        assert len(table) <= 4, "more than 4 distinct values in one tensor"
        for b in range(4):
            members = (q == b) & sure
            if members.any():
                want = float(x[q == b].mean())
                got = frame.values[j][members].double()
                assert torch.allclose(got, torch.full_like(got, want), rtol=1e-4, atol=1e-6), (spec.name, b)
        assert torch.equal(comp.error[j][frame.indices[j]], pre[frame.indices[j]] - frame.values[j])


def _check_topk(g: ChunkGrid, k_full: int, pre, indices) -> None:
    at = 0
    for c, n in enumerate(g.chunk_sizes()):
        flat = g.flat_index(torch.full((n,), c), torch.arange(n))
        k = min(n, -(-k_full * n // g.size))
        order = sorted(range(n), key=lambda p: (-abs(float(pre[flat[p]])), p))
        assert torch.equal(indices[at:at + k], flat[sorted(order[:k])]), f"chunk {c}: not its top-k"
        at += k


def _check_levels(x: torch.Tensor, decoded: torch.Tensor) -> None:
    m = sorted((abs(float(a)) for a in x), reverse=True)
    k, h = len(m), len(m) // 2
    hi = torch.tensor(m[h // 2]).to(torch.bfloat16).float()
    lo = torch.tensor(m[h + (k - h) // 2]).to(torch.bfloat16).float()
    mid = (lo + hi) * 0.5
    mag = torch.where(x.abs() >= mid, hi, lo)
    assert torch.equal(decoded, torch.where(torch.signbit(x), -mag, mag)), "the 2-bit values are not sign x {lo, hi}"


@pytest.mark.parametrize("backend", NAMES)
def test_the_same_errors_for_bad_deltas(backend):
    layout = _layout([(40, 70), (9,)])
    for bad, message in ((float("nan"), "pseudo-gradient 't1' contains NaN or Inf"),
                         (3e38, "error feedback for 't0' overflowed to Inf")):
        comp = Compressor(layout, tile=8, density=1 / 8, backend=backend)
        deltas = [torch.full((40, 70), 3e38), torch.ones(9)]
        if bad != bad:  # NaN
            deltas[1][4] = bad
        else:
            comp.compress(deltas, round=0, sender=0)
        with pytest.raises(ValueError, match=message):
            comp.compress(deltas, round=1, sender=0)


def _repaired(data: bytearray) -> bytes:
    """The frame with its checksum recomputed, so that the body's own checks are reached."""
    data[-4:] = zlib.crc32(bytes(data[:-4])).to_bytes(4, "little")
    return bytes(data)


def _outcome(data: bytes, layout: Layout, backend: str):
    try:
        frame = decode_frame(data, layout, backend=backend)
    except FrameError as exc:
        return str(exc)
    if frame.kind == "dense":
        return [d.tolist() for d in frame.dense]
    return [i.tolist() for i in frame.indices], [v.tolist() for v in frame.values]


@pytest.mark.slow
@pytest.mark.parametrize("backend", OTHERS)
def test_the_same_verdict_on_damaged_frames(backend):
    """Bit flips, byte overwrites and zeroed runs in the sections (checksum repaired): each backend
    accepts the same frames with the same content, and names the same first problem."""
    layout = _layout([(70, 130), (77,), (3, 5, 7)])
    seeds = [Compressor(layout, density=d, tile=t, table=table, index_coding=coding).compress(
        [values(s.shape, "normal", 5) for s in layout.specs], round=0, sender=0)
        for d, t, table, coding in ((1 / 16, 16, "chunk", "rice"), (1 / 64, 8, "tensor", "fixed"),
                                    (1 / 256, 16, "chunk", "rice"), (1 / 16, 16, "bins", "rice"))]
    seeds.append(encode_dense(layout, [values(s.shape, "normal", 6) for s in layout.specs], round=0, sender=0,
                              dtype="bf16"))
    rng = random.Random(4)
    verdicts = {"accepted": 0, "rejected": 0}
    for _ in range(600):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(HEADER_BYTES, len(data) - 4)
            u = rng.random()
            if u < 0.6:
                data[i] ^= 1 << rng.randrange(8)
            elif u < 0.8:
                data[i] = rng.randrange(256)
            else:  # zeros: long unary runs, some reaching past their segment
                n = rng.randint(1, 48)
                data[i:i + n] = bytes(len(data[i:i + n]))
        data = _repaired(data)
        want = _outcome(data, layout, "reference")
        assert _outcome(data, layout, backend) == want
        verdicts["rejected" if isinstance(want, str) else "accepted"] += 1
    assert min(verdicts.values()) > 50  # both outcomes are exercised


@pytest.mark.slow
@pytest.mark.parametrize("backend", OTHERS)
def test_the_same_verdict_on_long_runs_of_zeros_at_segment_ends(backend):
    """Zeroed bytes just before the end of each segment's indices: unary runs too long for
    their chunk, running past the segment, or both; every backend names the same one."""
    layout = _layout([(256, 320), (1000,)])  # tile 16: 320 + 4 chunks, 6 segments
    messages = []
    for density in (1 / 64, 1 / 4):  # the longest unary run: 7 and 127 bits
        data = Compressor(layout, density=density, tile=16).compress(
            [values(s.shape, "normal", 7) for s in layout.specs], round=0, sender=0)
        sections = read_sparse(data, read_header(data), layout)
        ends = np.frombuffer(sections.offsets, "<u4").tolist()[1:] + [len(sections.index)]
        for end in ends:
            for width in (1, 2, 5, 9, 17):
                for back in (0, 1, 3):
                    damaged = bytearray(data)
                    stop = sections.index_at + end - back
                    damaged[stop - width:stop] = bytes(width)
                    damaged = _repaired(damaged)
                    want = _outcome(damaged, layout, "reference")
                    assert _outcome(damaged, layout, backend) == want, (density, end, width, back)
                    messages.append(want if isinstance(want, str) else "accepted")
    assert any("unary run" in m for m in messages) and any("ends inside chunk" in m for m in messages)


@pytest.mark.slow
def test_the_numba_twins_of_the_layout_formulas_equal_the_python_ones():
    """layout's formulas run as Python and, compiled by numba, inside the kernels."""
    if "numba" not in BACKENDS:
        pytest.skip("numba not installed")
    from numba import njit

    from geoloco.compression import layout as lay

    @njit
    def compiled(n, k, size, c, rows, cols, tile, rt, ct, p):
        return (lay.kept_per_chunk(n, k, size), lay.code_bytes(k), lay.rice_param(n, k), lay.fixed_width(n),
                lay.rice_max_quotient(n, lay.rice_param(n, k)), lay.index_bytes_max(n, k, False),
                lay.index_bytes_max(n, k, True), lay.chunk_count(rows, cols, tile, rt, ct),
                lay.chunk_numel(c, rows, cols, tile, rt, ct), lay.tile_shift(tile),
                lay.leftover_numel(rows, cols, tile, rt, ct), lay.flat_index(c, p, rows, cols, tile, rt, ct))

    def plain(n, k, size, c, rows, cols, tile, rt, ct, p):
        return compiled.py_func(n, k, size, c, rows, cols, tile, rt, ct, p)

    rng = random.Random(0)
    for _ in range(3000):
        tile = rng.choice([1, 2, 3, 8, 16, 64, 100, 256])
        size = tile * tile
        n = rng.randint(1, size)
        k = rng.randint(1, n)
        g = ChunkGrid.of(rng.choice([(rng.randint(0, 600), rng.randint(0, 600)), (rng.randint(0, 9000),)]), tile)
        if not g.n_chunks:
            continue
        c = rng.randrange(g.n_chunks)
        p = rng.randrange(g.chunk_sizes()[c])
        args = (n, k, size, c, *g.dims, p)
        assert compiled(*args) == plain(*args), args


@pytest.mark.parametrize("shape, tile", [((130, 200), 16), ((64, WIDE), 64), ((7, 9), 3), ((500,), 8), ((3, 4, 5), 2)])
def test_vectorized_flat_index_equals_the_scalar_formula_and_covers_every_element(shape, tile):
    from geoloco.compression.layout import flat_index

    g = ChunkGrid.of(shape, tile)
    sizes = g.chunk_sizes()
    chunk = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    pos = torch.cat([torch.arange(n) for n in sizes])
    flat = g.flat_index(chunk, pos)
    assert torch.equal(torch.sort(flat).values, torch.arange(g.numel))
    picks = np.random.default_rng(0).choice(len(pos), size=min(len(pos), 2000), replace=False)
    for i in picks.tolist():
        assert flat_index(int(chunk[i]), int(pos[i]), *g.dims) == int(flat[i])
