"""The frame format, version 2 (docs/codec.md, "Frame format"): header, sections and
checksum; writing frames, and every structural check on reading one.

Byte layout (little-endian):

    header   magic "GLCF", version, kind, p1, p2, layout digest (16), round u64,
             sender u32, tensors u32, elements u64, tile u16, k u32, body length u64
    body     sections, each: codec u8 (0 raw, 1 zstd), raw length u64, stored length u64,
             stored bytes. Sparse: table, codes, index, index offsets (u32 per segment of
             64 chunks, so that threads can decode a frame together). Dense: values.
    trailer  CRC-32 of everything before it, u32

Every count and length read from a frame is checked against what the layout allows
before anything is allocated. What the sections hold (levels, offsets, coded positions) is
checked by a backend; the problems it finds are the codes below, and ``index_error`` and
``table_error`` turn them into messages, so that every backend words them the same way.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import numpy as np
import torch

from .layout import SEGMENT_CHUNKS, FrameGeometry, Layout, frame_geometry

try:
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None

MAGIC = b"GLCF"
VERSION = 2  # 2: sparse frames carry index offsets per segment of chunks
KIND_SPARSE, KIND_DENSE = 1, 2
TABLE_PER_TENSOR, TABLE_PER_CHUNK, TABLE_BINS = 0, 1, 2  # TABLE_BINS: the 4-bin quantizer, per tensor
INDEX_FIXED, INDEX_RICE = 0, 1
DTYPE_FP32, DTYPE_BF16 = 0, 1
MAX_TILE = 256  # the largest chunk side: in-chunk positions fit 16 bits

_HEADER = struct.Struct("<4sBBBB16sQIIQHIQ")
_SECTION = struct.Struct("<BQQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size
SECTION_BYTES = _SECTION.size
CRC_BYTES = _CRC.size

DENSE_DTYPES = {DTYPE_FP32: (torch.float32, 4, "fp32"), DTYPE_BF16: (torch.bfloat16, 2, "bf16")}
DENSE_DTYPE_CODES = {"fp32": DTYPE_FP32, "bf16": DTYPE_BF16}

CRC_MISMATCH = "checksum mismatch: frame corrupted"


class FrameError(ValueError):
    """A frame is malformed, corrupted, or made for another layout; the message says which."""


# ----------------------------------------------------------------------------- problems

# What a backend finds in a sparse frame's sections, 0 = none. Per chunk, in this order,
# for each code: it ends past its segment (truncated); a Rice unary run is longer than
# rice_max_quotient; the position is outside the chunk; a fixed-width position is not above
# the previous one. Then the chunk's index padding bits, then its 2-bit code padding;
# after a segment's last chunk, where its indices end.
OK = 0
INDEX_TRUNCATED = 1
UNARY_TOO_LONG = 2
INDEX_RANGE = 3
INDEX_ORDER = 4
INDEX_PADDING = 5
CODE_PADDING = 6
SEGMENT_END = 7
# ... and in the table and offsets sections, checked first, in this order
OFFSETS_START = 8
OFFSETS_BEYOND = 9
OFFSETS_BACK = 10
LEVELS_BAD = 11
LEVELS_ORDER = 12
BINS_BAD = 13

_INDEX_MESSAGES = {
    INDEX_TRUNCATED: "index section ends inside chunk {c}",
    UNARY_TOO_LONG: "Rice code in chunk {c} has a unary run longer than the chunk allows",
    INDEX_RANGE: "index in chunk {c} is outside the chunk",
    INDEX_ORDER: "indices in chunk {c} are not strictly increasing",
    INDEX_PADDING: "nonzero padding bits after the indices of chunk {c}",
    CODE_PADDING: "nonzero padding bits after the 2-bit codes of chunk {c}",
    SEGMENT_END: "the indices of segment {s} do not end where the next segment's offset says",
}
_TABLE_MESSAGES = {
    OFFSETS_START: "index offsets start at {v}, not 0",
    OFFSETS_BEYOND: "index offset of segment {s} ({v}) lies beyond the index section ({w} bytes)",
    OFFSETS_BACK: "index offset of segment {s} ({v}) lies before segment {s1}'s ({w})",
    LEVELS_BAD: "quantizer table holds a negative, NaN or Inf level",
    LEVELS_ORDER: "quantizer table has a low level above the high level",
    BINS_BAD: "quantizer table holds a NaN or Inf bin value",
}


def index_error(geometry: FrameGeometry, status: int, tensor: int, chunk: int, segment: int) -> FrameError:
    """The FrameError for a problem in chunk ``chunk`` of tensor ``tensor`` (SEGMENT_END:
    named after the tensor of the segment's last chunk, the layout's last tensor for the
    frame's last segment)."""
    specs = geometry.layout.specs
    if status == SEGMENT_END:
        last = min(len(geometry.chunks), (segment + 1) * SEGMENT_CHUNKS) - 1
        full = last - segment * SEGMENT_CHUNKS + 1 == SEGMENT_CHUNKS
        tensor = int(geometry.chunks[last, 0]) if full else len(specs) - 1
    return FrameError(f"tensor {specs[tensor].name!r}: " + _INDEX_MESSAGES[status].format(c=chunk, s=segment))


def table_error(status: int, segment: int, value: int, other: int) -> FrameError:
    """The FrameError for a problem in the table or index offsets section."""
    return FrameError(_TABLE_MESSAGES[status].format(s=segment, s1=segment - 1, v=value, w=other))


# ----------------------------------------------------------------------------- writing


def index_offsets_section(chunk_index_bytes: np.ndarray) -> bytes:
    """The index offsets section from the index bytes of every chunk, in frame order."""
    ends = np.cumsum(chunk_index_bytes, dtype=np.int64)
    starts = (ends - chunk_index_bytes)[::SEGMENT_CHUNKS]
    if len(starts) and starts[-1] >= 2**32:
        raise ValueError("index section over 4 GiB: cut the model into several layouts")
    return starts.astype("<u4").tobytes()


def _section(raw: bytes, use_zstd: bool) -> bytes:
    stored, codec = raw, 0
    if use_zstd and raw and zstandard is not None:
        z = zstandard.ZstdCompressor(level=3).compress(raw)
        if len(z) < len(raw):
            stored, codec = z, 1
    return _SECTION.pack(codec, len(raw), len(stored)) + stored


def write_frame(kind: int, p1: int, p2: int, layout: Layout, round: int, sender: int,
                tile: int, k_full: int, sections: list[bytes], use_zstd: bool) -> bytes:
    body = b"".join(_section(s, use_zstd) for s in sections)
    head = _header(kind, p1, p2, layout, round, sender, tile, k_full, len(body))
    crc = zlib.crc32(body, zlib.crc32(head))
    return head + body + _CRC.pack(crc)


def _header(kind: int, p1: int, p2: int, layout: Layout, round: int, sender: int, tile: int, k_full: int,
            body_len: int) -> bytes:
    if not 0 <= round < 2**64 or not 0 <= sender < 2**32:
        raise ValueError(f"round must be in [0, 2**64) and sender in [0, 2**32), got {round}, {sender}")
    return _HEADER.pack(MAGIC, VERSION, kind, p1, p2, layout.digest, round, sender,
                        len(layout.specs), layout.numel, tile, k_full, body_len)


def raw_frame(kind: int, p1: int, layout: Layout, round: int, sender: int, raw_len: int) -> tuple[bytearray, int]:
    """A frame of one raw section of ``raw_len`` bytes (a dense frame without zstd), as one
    buffer to fill in place: the header and the section's are written; the section starts at
    the offset returned; ``seal_frame`` then writes the checksum. ``write_frame``'s bytes,
    without its copies of the section (a model's size for the coordinator's state)."""
    head = _header(kind, p1, 0, layout, round, sender, 0, 0, _SECTION.size + raw_len)
    out = bytearray(len(head) + _SECTION.size + raw_len + CRC_BYTES)
    out[:len(head)] = head
    _SECTION.pack_into(out, len(head), 0, raw_len, raw_len)
    return out, len(head) + _SECTION.size


def seal_frame(out: bytearray) -> bytearray:
    """``raw_frame``'s buffer, filled, with its checksum written."""
    end = len(out) - CRC_BYTES
    _CRC.pack_into(out, end, zlib.crc32(memoryview(out)[:end]))
    return out


def dense_frame_bytes(layout: Layout, dtype: str = "fp32") -> int:
    """The size of a dense frame of ``layout`` without zstd."""
    return HEADER_BYTES + _SECTION.size + layout.numel * DENSE_DTYPES[DENSE_DTYPE_CODES[dtype]][1] + CRC_BYTES


# ----------------------------------------------------------------------------- reading


class Header(NamedTuple):
    kind: int
    p1: int
    p2: int
    digest: bytes
    round: int
    sender: int
    n_tensors: int
    numel: int
    tile: int
    k_full: int
    body_len: int


class SparseSections(NamedTuple):
    """A sparse frame's sections, sized against its layout (their contents not yet checked)."""

    geometry: FrameGeometry
    data: bytes                     # the whole frame
    table: bytes | memoryview       # raw sections: views of data; decompressed ones: bytes
    codes: bytes | memoryview
    index: bytes | memoryview
    offsets: bytes | memoryview
    index_at: int                   # where the index section starts in data (-1: decompressed)


def is_bins_frame(data: bytes) -> bool:
    """Whether ``data`` claims to be a sparse frame of the 4-bin quantizer (its header's
    kind and table mode; nothing is checked)."""
    return len(data) >= HEADER_BYTES and data[5] == KIND_SPARSE and data[6] == TABLE_BINS


def crc_matches(data: bytes) -> bool:
    (crc,) = _CRC.unpack_from(data, len(data) - CRC_BYTES)
    return zlib.crc32(memoryview(data)[:-CRC_BYTES]) == crc


def read_header(data: bytes, check_crc: bool = True) -> Header:
    """The header, after the length, magic, version, total length and (unless the caller
    checks it itself) checksum checks, in that order."""
    if len(data) < HEADER_BYTES + CRC_BYTES:
        raise FrameError(f"frame truncated: {len(data)} bytes, shorter than the {HEADER_BYTES + CRC_BYTES}-byte "
                         "header and checksum")
    magic, version, *fields = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}: not a GeoLoCo frame")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this codec reads version {VERSION})")
    head = Header(*fields)
    expected = HEADER_BYTES + head.body_len + CRC_BYTES
    if len(data) < expected:
        raise FrameError(f"frame truncated: {len(data)} bytes, header says {expected}")
    if len(data) > expected:
        raise FrameError(f"{len(data) - expected} trailing bytes after the frame (concatenated or oversized frame)")
    if check_crc and not crc_matches(data):
        raise FrameError(CRC_MISMATCH)
    return head


def check_layout(head: Header, layout: Layout) -> None:
    """The kind, then the header's counts and digest against the layout."""
    if head.kind not in (KIND_SPARSE, KIND_DENSE):
        raise FrameError(f"unknown frame kind {head.kind}")
    if head.n_tensors != len(layout.specs) or head.numel != layout.numel:
        raise FrameError(f"frame is for another layout: {head.n_tensors} tensors / {head.numel} elements, "
                         f"this layout has {len(layout.specs)} / {layout.numel}")
    if head.digest != layout.digest:
        raise FrameError(f"frame is for another layout: digest {head.digest.hex()} != {layout.digest.hex()} "
                         "(tensor names, shapes or dtypes differ)")


def read_sections(body: memoryview, expected: list[tuple[str, int, bool]],
                  starts: list[int] | None = None) -> list[bytes | memoryview]:
    """Read sections named in ``expected`` as (name, length, exact); length is a maximum
    unless exact. Raw sections come back as views of body, zstd ones as bytes; where each
    one's stored bytes start in body goes to starts."""
    out, pos = [], 0
    for name, length, exact in expected:
        if len(body) - pos < _SECTION.size:
            raise FrameError(f"{name} section header missing: body ends at byte {pos}")
        codec, raw_len, stored_len = _SECTION.unpack_from(body, pos)
        pos += _SECTION.size
        if codec not in (0, 1):
            raise FrameError(f"{name} section has unknown codec {codec}")
        if (raw_len != length) if exact else (raw_len > length):
            want = f"{length}" if exact else f"at most {length}"
            raise FrameError(f"{name} section claims {raw_len} bytes, the layout allows {want}")
        if stored_len > len(body) - pos:
            raise FrameError(f"{name} section claims {stored_len} stored bytes, only {len(body) - pos} left")
        stored = body[pos:pos + stored_len]
        if starts is not None:
            starts.append(pos)
        pos += stored_len
        if codec == 0:
            if stored_len != raw_len:
                raise FrameError(f"{name} section: raw section stores {stored_len} bytes, not {raw_len}")
            out.append(stored)  # a view of the frame: no copy
        else:
            out.append(_unzstd(name, stored, raw_len))
    if pos != len(body):
        raise FrameError(f"{len(body) - pos} unexpected bytes after the last section")
    return out


def _unzstd(name: str, stored: memoryview, raw_len: int) -> bytes:
    if zstandard is None:
        raise FrameError(f"{name} section is zstd-compressed but the zstandard package is missing")
    try:
        size = zstandard.frame_content_size(bytes(stored[:18]))
        if size != raw_len:
            raise FrameError(f"{name} section: zstd content size {size} != declared {raw_len}")
        raw = zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise FrameError(f"{name} section: corrupt zstd data ({exc})") from None
    if len(raw) != raw_len:
        raise FrameError(f"{name} section: zstd data decompresses to {len(raw)} bytes, not {raw_len}")
    return raw


def _body(data: bytes) -> memoryview:
    return memoryview(data)[HEADER_BYTES:-CRC_BYTES]


def read_dense(data: bytes, head: Header, layout: Layout) -> list[torch.Tensor]:
    """A dense frame's values as fp32 tensors, one per tensor of the layout (flat)."""
    if head.p1 not in DENSE_DTYPES or head.p2 or head.tile or head.k_full:
        raise FrameError(f"dense frame has invalid parameters (dtype {head.p1}, {head.p2}, {head.tile}, "
                         f"{head.k_full})")
    tdtype, width, _ = DENSE_DTYPES[head.p1]
    (raw,) = read_sections(_body(data), [("values", layout.numel * width, True)])
    itype = torch.int16 if width == 2 else torch.int32
    flat = torch.frombuffer(bytearray(raw), dtype=itype) if raw else torch.empty(0, dtype=itype)
    flat = flat.view(tdtype).float()
    if not torch.isfinite(flat).all():
        raise FrameError("dense frame contains NaN or Inf values")
    bounds = np.cumsum([0] + [s.numel for s in layout.specs]).tolist()
    return [flat[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def read_sparse(data: bytes, head: Header, layout: Layout) -> SparseSections:
    """A sparse frame's codec parameters and sections, each of the size its layout implies."""
    if head.p1 not in (TABLE_PER_TENSOR, TABLE_PER_CHUNK, TABLE_BINS) or head.p2 not in (INDEX_FIXED, INDEX_RICE):
        raise FrameError(f"sparse frame has unknown table mode {head.p1} or index coding {head.p2}")
    if not 1 <= head.tile <= MAX_TILE:
        raise FrameError(f"tile {head.tile} outside [1, {MAX_TILE}]")
    if not 1 <= head.k_full <= head.tile * head.tile:
        raise FrameError(f"kept per chunk {head.k_full} outside [1, {head.tile * head.tile}]")
    fixed = head.p2 == INDEX_FIXED
    geo = frame_geometry(layout, head.tile, head.k_full, head.p1 == TABLE_PER_CHUNK, fixed, head.p1 == TABLE_BINS)
    starts: list[int] = []
    table, codes, index, offsets = read_sections(
        _body(data), [("table", geo.table_bytes, True), ("codes", geo.code_bytes, True),
                      ("index", geo.index_bytes_max, fixed), ("index offsets", 4 * len(geo.seg_start), True)],
        starts)
    index_at = HEADER_BYTES + starts[2] if isinstance(index, memoryview) else -1
    return SparseSections(geo, data, table, codes, index, offsets, index_at)
