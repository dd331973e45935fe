"""Bit-exact sparse weight deltas ("overwrite" semantics) for bf16, fp16 and fp32 tensors.

A payload carries the positions whose raw bits changed and the new raw bits there, never an
arithmetic difference, so applying it is idempotent and reproduces `new` exactly: NaN
payloads, infinities and -0.0 included (comparison and copying happen on the integer view).

Layout (little-endian)::

    header  magic "RSD1", kind (0 full, 1 delta), dtype, flags (1 = zstd), ndim,
            n_changed, n_escapes, raw_len, stored_len, result_hash, shape[ndim], check
    body    full:  the tensor's raw bytes
            delta: escapes: gap distances above 255, in order (uint32; uint64 for tensors of
                     2**32 elements or more)
                   | new raw bits (bitmap-chunk elements first, then the gap-coded ones)
                   | chunk kinds (one byte per CHUNK elements: 0 gaps, 1 bitmap)
                   | bitmaps of the bitmap chunks
                   | gaps: one byte per other changed index, its distance from the previous
                     one (1-255), or 0 for "the next escape"
            (the word-sized fields first, so that they stay aligned: numpy scatters unaligned
            values 60% slower)

The gaps are a byte-aligned varint split into two streams (patched coding, as in PFOR): at
the 0.6-5% densities of RL steps nearly every gap fits a byte, and decoding is one cumsum.

`result_hash` is xxh3-64 of the resulting tensor's bytes; `check` is xxh3-64 of the header
and, for a delta, the stored body, so corruption is caught before anything is written. A full
body is the resulting tensor itself: `result_hash` checks it before the copy, and hashing it a
second time (for `check`, or after the copy) would only double the cost of full syncs. The
checks are no MAC, so every size a header declares (and a zstd frame's declared content size)
is checked against the target tensor before anything is allocated for it. The two
per-element loops (finding changed elements, scattering gap-coded ones) are compiled
(`kernels.py`); the rest is vectorised numpy: no Python loop runs per element or per chunk.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
import xxhash
import zstandard

from rose.transfer import kernels

MAGIC = b"RSD1"
FULL, DELTA = 0, 1
ZSTD = 1
CHUNK_SHIFT = 16
CHUNK = 1 << CHUNK_SHIFT  # elements per index chunk; a bitmap chunk costs CHUNK / 8 bytes
_FIXED = struct.Struct("<4sBBBBQQQQQ")
_CHECK = struct.Struct("<Q")
# dtype -> (wire code, integer view of the same width)
_DTYPES: dict[torch.dtype, tuple[int, torch.dtype]] = {
    torch.bfloat16: (1, torch.int16),
    torch.float16: (2, torch.int16),
    torch.float32: (3, torch.int32),
}
_T = TypeVar("_T")
_BY_CODE = {code: dtype for dtype, (code, _) in _DTYPES.items()}


class CorruptDelta(ValueError):
    """A payload is corrupt, truncated, or does not match the tensor it is applied to."""


@dataclasses.dataclass(frozen=True)
class Encoded:
    """An encoded tensor as (header, body): kept apart so a large body is never copied to join them."""

    header: bytes
    body: np.ndarray  # uint8
    changed: int  # elements whose bits changed (numel for a full copy not made from a delta)
    full: bool

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.body.nbytes

    def to_bytes(self) -> bytes:
        return self.header + self.body.tobytes()


def tensor_hash(t: torch.Tensor) -> int:
    """xxh3-64 of a tensor's bytes in row-major order (the streaming form releases the GIL)."""
    return xxhash.xxh3_64(_flat(t).view(np.uint8)).intdigest()


def encode(old: torch.Tensor, new: torch.Tensor, *, zstd_level: int | None = None) -> bytes:
    """The payload that turns `old` into `new` bit-exactly; a full payload when that is smaller."""
    return encode_delta(old, new, zstd_level=zstd_level, advance=False).to_bytes()


def apply(old: torch.Tensor, payload: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
    """A new tensor: `old` with `payload` applied, verified against the sender's checksum."""
    out = old.detach().clone(memory_format=torch.contiguous_format)
    header, body = split_payload(payload)
    apply_into(out, header, body)
    return out


def encode_full(new: torch.Tensor) -> Encoded:
    """A payload holding all of `new` (for new or late receivers and periodic full syncs)."""
    src = _flat(new)
    body = src.view(np.uint8)
    return Encoded(_header(FULL, new, src.size, 0, body.nbytes, body, xxhash.xxh3_64(body).intdigest(), 0),
                   body, src.size, True)


def encode_delta(base: torch.Tensor, new: torch.Tensor, *, zstd_level: int | None = None,
                 advance: bool = True) -> Encoded:
    """Encode `new` against `base`; with `advance`, also bring `base` to `new` in place.

    The sender keeps `base` as its baseline: advancing it rewrites only the 8-byte words that
    changed (a strided baseline is copied out and written back whole).
    """
    _check_pair(base, new)
    b = _flat(new)
    if advance:
        idx, vals = _in_place(base, lambda a: _changed(a, b, True))
    else:
        idx, vals = _changed(_flat(base), b, False)
    result_hash = xxhash.xxh3_64(b.view(np.uint8)).intdigest()
    body, n_escapes = _delta_body(idx, vals, b.size)
    if body.nbytes >= b.nbytes:  # dense change: the raw tensor is smaller
        return dataclasses.replace(encode_full(new), changed=idx.size)
    flags, stored = 0, body
    if zstd_level is not None:
        packed = zstandard.ZstdCompressor(level=zstd_level).compress(body)
        if len(packed) < body.nbytes:
            flags, stored = ZSTD, np.frombuffer(packed, np.uint8)
    header = _header(DELTA, new, idx.size, n_escapes, body.nbytes, stored, result_hash, flags)
    return Encoded(header, stored, idx.size, False)


def copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src on the raw bits (any strides), without torch's thread pool."""
    _check_pair(dst, src)
    np.copyto(_raw(dst), _raw(src))


def split_payload(payload: bytes | bytearray | memoryview | np.ndarray) -> tuple[bytes, np.ndarray]:
    """(header, body) of a one-piece payload, checking its length against the header."""
    buf = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload.view(np.uint8)
    if buf.size < _FIXED.size:
        raise CorruptDelta(f"truncated payload: {buf.size} bytes, a header needs at least {_FIXED.size}")
    ndim = _FIXED.unpack_from(buf)[4]
    head_len = _FIXED.size + 8 * ndim + _CHECK.size
    if buf.size < head_len:
        raise CorruptDelta(f"truncated header: {buf.size} bytes, expected {head_len}")
    stored_len = _FIXED.unpack_from(buf)[8]
    if buf.size != head_len + stored_len:
        raise CorruptDelta(f"payload is {buf.size} bytes, header says {head_len + stored_len} "
                           "(truncated or extended)")
    return buf[:head_len].tobytes(), buf[head_len:]


def apply_into(target: torch.Tensor, header: bytes, body: np.ndarray) -> int:
    """Apply one payload to `target` in place (any strides) and verify the result's checksum.

    Returns the number of elements the payload carries. Header, checksum and index checks all
    run before the first write; a result mismatch after writing means `target` was not the
    sender's baseline, and the caller needs a full sync.
    """
    h = _parse(header, body)
    _check_fits(h, target)
    numel = target.numel()
    if h.flags & ZSTD:
        body = _decompress(body, h.raw_len)
    if body.nbytes != h.raw_len:
        raise CorruptDelta(f"body is {body.nbytes} bytes, header says {h.raw_len}")
    if h.kind == FULL:
        if xxhash.xxh3_64(body).intdigest() != h.result_hash:
            raise CorruptDelta("payload checksum mismatch: full body corrupted in transit")
        np.copyto(_bits(target).numpy(), body.view(_np_int(target)).reshape(target.shape))
        return h.n_changed
    delta = _parse_delta(body, h.n_changed, h.n_escapes, numel, target)
    if _in_place(target, lambda flat: _apply_delta(flat, *delta)) != h.result_hash:
        raise CorruptDelta("result checksum mismatch: the tensor the delta was applied to is not the "
                           "sender's baseline; a full sync is needed")
    return h.n_changed


# ----------------------------------------------------------------------------------- internals


def _raw(t: torch.Tensor) -> np.ndarray:
    """The integer numpy view sharing `t`'s memory (strided views stay strided)."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {t.dtype}; expected one of bfloat16, float16, float32")
    return _bits(t).numpy()


def _flat(t: torch.Tensor) -> np.ndarray:
    """The raw bits as a flat array: a view when `t` is contiguous, else a copy (numpy's, single-threaded:
    torch's copy would wake its thread pool inside every sync thread)."""
    return np.ascontiguousarray(_raw(t)).reshape(-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_DTYPES[t.dtype][1])


def _np_int(t: torch.Tensor) -> type:
    return np.int16 if t.element_size() == 2 else np.int32


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype:
        raise ValueError(f"dtype mismatch: old is {old.dtype}, new is {new.dtype}")
    if old.shape != new.shape:
        raise ValueError(f"shape mismatch: old is {tuple(old.shape)}, new is {tuple(new.shape)}")
    if new.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {new.dtype}; expected one of bfloat16, float16, float32")


def _changed(a: np.ndarray, b: np.ndarray, advance: bool) -> tuple[np.ndarray, np.ndarray]:
    """Sorted flat indices where the raw bits differ, and `b`'s bits there; with `advance`,
    `a` takes `b`'s bits. The output buffers are sized for the worst case but only the
    entries written are ever touched (and so backed by memory)."""
    lanes = 8 // a.itemsize
    words = a.size // lanes * lanes  # the elements in whole 8-byte words
    idx, vals = np.empty(a.size, np.int64), np.empty(a.size, a.dtype)
    k = kernels.find_changed(a, b, a[:words].view(np.uint64), b[:words].view(np.uint64), lanes, idx, vals,
                             advance)
    return idx[:k], vals[:k]


def _in_place(t: torch.Tensor, fn: Callable[[np.ndarray], _T]) -> _T:
    """`fn` of `t`'s raw bits as a flat array it may write to: a view of a contiguous tensor,
    else a copy written back afterwards."""
    raw = _raw(t)
    if raw.flags.c_contiguous:
        return fn(raw.reshape(-1))
    flat = raw.flatten()
    out = fn(flat)
    raw[...] = flat.reshape(raw.shape)
    return out


def _header(kind: int, t: torch.Tensor, n_changed: int, n_escapes: int, raw_len: int, stored: np.ndarray,
            result_hash: int, flags: int) -> bytes:
    fixed = _FIXED.pack(MAGIC, kind, _DTYPES[t.dtype][0], flags, t.dim(), n_changed, n_escapes, raw_len,
                        stored.nbytes, result_hash)
    head = fixed + struct.pack(f"<{t.dim()}Q", *t.shape)
    check = xxhash.xxh3_64(head)
    if kind == DELTA:
        check.update(stored)
    return head + _CHECK.pack(check.intdigest())


@dataclasses.dataclass(frozen=True)
class _Header:
    kind: int
    dtype: torch.dtype
    flags: int
    n_changed: int
    n_escapes: int
    raw_len: int
    result_hash: int
    shape: tuple[int, ...]


def _parse(header: bytes, body: np.ndarray) -> _Header:
    if len(header) < _FIXED.size:
        raise CorruptDelta(f"truncated header: {len(header)} bytes, need at least {_FIXED.size}")
    magic, kind, code, flags, ndim, n_changed, n_escapes, raw_len, stored_len, result_hash = \
        _FIXED.unpack_from(header)
    if magic != MAGIC:
        raise CorruptDelta(f"not a ROSE weight payload: magic {magic!r}, expected {MAGIC!r}")
    if len(header) != _FIXED.size + 8 * ndim + _CHECK.size:
        raise CorruptDelta(f"header is {len(header)} bytes, expected {_FIXED.size + 8 * ndim + _CHECK.size}")
    if body.nbytes != stored_len:
        raise CorruptDelta(f"truncated body: {body.nbytes} bytes, header says {stored_len}")
    check = xxhash.xxh3_64(header[:-_CHECK.size])
    if kind != FULL:
        check.update(body)
    if check.intdigest() != _CHECK.unpack_from(header, len(header) - _CHECK.size)[0]:
        raise CorruptDelta("payload checksum mismatch: header or body corrupted in transit")
    # Past the check a bad field is an encoder bug or a forged payload; still refuse it cleanly.
    if kind not in (FULL, DELTA) or code not in _BY_CODE or flags & ~ZSTD:
        raise CorruptDelta(f"unknown kind {kind}, dtype code {code} or flags {flags}")
    shape = struct.unpack_from(f"<{ndim}Q", header, _FIXED.size)
    return _Header(kind, _BY_CODE[code], flags, n_changed, n_escapes, raw_len, result_hash, shape)


def _check_fits(h: _Header, target: torch.Tensor) -> None:
    """Every size the header declares must fit `target` before anything is allocated for it:
    the checksum is no MAC, so a forged header may declare anything."""
    if h.dtype != target.dtype:
        raise CorruptDelta(f"dtype mismatch: payload holds {h.dtype}, tensor is {target.dtype}")
    if h.shape != tuple(target.shape):
        raise CorruptDelta(f"shape mismatch: payload holds {h.shape}, tensor is {tuple(target.shape)}")
    numel, nbytes = target.numel(), target.numel() * target.element_size()
    if h.kind == FULL and h.raw_len != nbytes:
        raise CorruptDelta(f"full payload is {h.raw_len} bytes, tensor needs {nbytes}")
    if h.kind == DELTA and h.raw_len >= nbytes:  # the encoder sends such a delta as a full copy
        raise CorruptDelta(f"delta body declares {h.raw_len} bytes, a delta must be smaller than the "
                           f"tensor's {nbytes}")
    if not h.n_escapes <= h.n_changed <= numel:
        raise CorruptDelta(f"payload declares {h.n_changed} changed elements and {h.n_escapes} escapes "
                           f"for a tensor of {numel} elements")


def _decompress(body: np.ndarray, raw_len: int) -> np.ndarray:
    """The zstd frame in `body`, which must declare exactly `raw_len` (already checked against the
    tensor) as its content size: zstandard allocates whatever a frame declares, whatever the cap."""
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise CorruptDelta(f"zstd body has no valid frame header: {exc}") from exc
    if declared != raw_len:
        got = "no size" if declared == -1 else f"{declared} bytes"
        raise CorruptDelta(f"zstd frame declares {got}, header says {raw_len} bytes")
    try:
        raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptDelta(f"zstd body does not decompress: {exc}") from exc
    return np.frombuffer(raw, np.uint8)


def _delta_body(idx: np.ndarray, vals: np.ndarray, numel: int) -> tuple[np.ndarray, int]:
    """The delta body for sorted changed indices `idx` and their new bits `vals`; and its escape count."""
    n_chunks = -(-numel // CHUNK)
    # A gap costs at least one byte, so a chunk with more than CHUNK / 8 changes is smaller as
    # a bitmap; below that gaps win.
    is_bitmap = np.zeros(n_chunks, bool)
    if idx.size > CHUNK // 8:  # idx is sorted: count per chunk by bisection, not a pass over idx
        bounds = np.searchsorted(idx, np.arange(n_chunks + 1, dtype=np.int64) << CHUNK_SHIFT)
        is_bitmap = np.diff(bounds) > CHUNK // 8
    bitmap = np.empty(0, np.uint8)
    gap_idx = idx
    if is_bitmap.any():
        chunk = idx >> CHUNK_SHIFT
        in_bitmap = is_bitmap[chunk]
        bits = np.zeros(int(is_bitmap.sum()) * CHUNK, bool)
        rank = np.cumsum(is_bitmap) - 1  # position of each bitmap chunk among the bitmaps
        bits[(rank[chunk[in_bitmap]] << CHUNK_SHIFT) | (idx[in_bitmap] & (CHUNK - 1))] = True
        bitmap = np.packbits(bits, bitorder="little")
        gap_idx = idx[~in_bitmap]
        vals = np.concatenate([vals[in_bitmap], vals[~in_bitmap]])
    dist = np.diff(gap_idx, prepend=-1)
    escaped = np.flatnonzero(dist > 255)
    gaps = dist.astype(np.uint8)
    gaps[escaped] = 0
    escapes = dist[escaped].astype(_escape_dtype(numel))
    parts = [escapes.view(np.uint8), vals.view(np.uint8), is_bitmap.view(np.uint8), bitmap, gaps]
    return np.concatenate(parts), escapes.size


def _escape_dtype(numel: int) -> type:
    return np.uint32 if numel < 1 << 32 else np.uint64


def _parse_delta(body: np.ndarray, n_changed: int, n_escapes: int, numel: int,
                 target: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Checks a delta body against its header and the tensor before anything is written.
    Returns the bitmap chunks' positions, the gaps, the escapes, and the values (bitmap ones
    first)."""
    n_chunks = -(-numel // CHUNK)
    esc_dtype = _escape_dtype(numel)
    esc_bytes = n_escapes * np.dtype(esc_dtype).itemsize
    pos = esc_bytes + n_changed * target.element_size()  # the chunk kinds
    if body.size < pos + n_chunks:
        raise CorruptDelta(f"delta body of {body.size} bytes cannot hold its values and chunk kinds")
    kinds = body[pos:pos + n_chunks]
    if (kinds > 1).any():
        raise CorruptDelta("delta chunk kind out of range")
    bitmap_chunks = np.flatnonzero(kinds)
    start, pos = pos + n_chunks, pos + n_chunks + bitmap_chunks.size * CHUNK // 8
    set_bits = np.flatnonzero(np.unpackbits(body[start:pos], bitorder="little"))
    n_gaps = n_changed - set_bits.size
    if n_gaps < 0 or body.size != pos + n_gaps:
        raise CorruptDelta(f"delta body is {body.size} bytes, its fields need {pos + max(n_gaps, 0)}")
    idx_b = (bitmap_chunks[set_bits >> CHUNK_SHIFT] << CHUNK_SHIFT) | (set_bits & (CHUNK - 1))
    gaps, escapes = body[pos:], body[:esc_bytes].view(esc_dtype)
    if np.count_nonzero(gaps == 0) != n_escapes or (escapes <= 255).any() or (escapes > numel).any():
        raise CorruptDelta("delta gap escapes do not match their markers")
    # Every distance is at least 1, so positions rise and the last one bounds them all.
    last = int(gaps.sum(dtype=np.int64)) + int(escapes.sum(dtype=np.int64)) - 1
    if (idx_b.size and idx_b[-1] >= numel) or last >= numel:
        raise CorruptDelta(f"delta index out of range for a tensor of {numel} elements")
    return idx_b, gaps, escapes, body[esc_bytes:esc_bytes + n_changed * target.element_size()].view(
        _np_int(target))


def _apply_delta(flat: np.ndarray, idx_b: np.ndarray, gaps: np.ndarray, escapes: np.ndarray,
                 vals: np.ndarray) -> int:
    """Writes a checked delta into `flat`; returns xxh3 of the result (hashed here, so that a
    strided tensor's flat copy serves the check too)."""
    flat[idx_b] = vals[:idx_b.size]
    kernels.scatter_gaps(flat, gaps, escapes.astype(np.int64), vals[idx_b.size:])
    return xxhash.xxh3_64(flat.view(np.uint8)).intdigest()
