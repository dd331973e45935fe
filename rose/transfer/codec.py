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
is checked against the target tensor before anything is allocated for it, and every check
runs on the host before a byte goes to the device.

The format is written once, here, against `kernels.Kernels`: where the tensors live chooses the
kernels (numba loops and numpy for CPU tensors, torch ops on the device for any other), and every
path writes the same bytes, so a delta encoded on one device applies on any other. No Python
loop runs per element or per chunk.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import xxhash
import zstandard

from rose.transfer.kernels import NUMBA, Kernels, for_device

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
    k = for_device(t.device)
    return k.hash(k.flat(_array(t, k)))


def host_bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bytes in row-major order as a flat host array: a view of a contiguous CPU
    tensor, else a copy (through pinned memory from a CUDA device)."""
    k = for_device(t.device)
    return k.to_host(k.view(k.flat(_array(t, k)), "uint8"))


def load_bits(dst: torch.Tensor, src: np.ndarray) -> None:
    """dst[...] = src on the raw bits: `src` a host array of `dst`'s shape and element width
    (any strides, on both sides); a device `dst` receives it through pinned memory."""
    k = for_device(dst.device)
    _array(dst, k)[...] = k.from_host(src)


def encode(old: torch.Tensor, new: torch.Tensor, *, zstd_level: int | None = None) -> bytes:
    """The payload that turns `old` into `new` bit-exactly; a full payload when that is smaller."""
    return encode_delta(old, new, zstd_level=zstd_level, advance=False).to_bytes()


def apply(old: torch.Tensor, payload: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
    """A new tensor: `old` with `payload` applied, verified against the sender's checksum."""
    out = old.detach().clone(memory_format=torch.contiguous_format)
    header, body = split_payload(payload)
    apply_into(out, header, body)
    return out


def encode_full(new: torch.Tensor, *, kernels: Kernels | None = None) -> Encoded:
    """A payload holding all of `new` (for new or late receivers and periodic full syncs).

    `kernels` (default: by the tensor's device, see `kernels.for_device`) chooses the code path;
    every path writes the same bytes."""
    k = kernels or for_device(new.device)
    body = k.to_host(k.view(k.flat(_array(new, k)), "uint8"))
    numel = new.numel()
    return Encoded(_header(FULL, new, numel, 0, body.nbytes, body, xxhash.xxh3_64(body).intdigest(), 0),
                   body, numel, True)


def encode_delta(base: torch.Tensor, new: torch.Tensor, *, zstd_level: int | None = None,
                 advance: bool = True, kernels: Kernels | None = None) -> Encoded:
    """Encode `new` against `base` (on the same device); with `advance`, also bring `base` to
    `new` in place.

    The sender keeps `base` as its baseline: on CPU, advancing it rewrites only the 8-byte words
    that changed (a strided baseline is copied out and written back whole).
    """
    _check_pair(base, new)
    k = kernels or for_device(new.device)
    b = k.flat(_array(new, k))
    if advance:
        idx, vals = _in_place(base, k, lambda a: k.changed(a, b, True))
    else:
        idx, vals = k.changed(k.flat(_array(base, k)), b, False)
    # Each change costs its value and at least a bitmap bit: a change this dense (an adapter's
    # step changes every element) is smaller whole, known before a body is built.
    if len(idx) * (8 * b.nbytes // max(b.shape[0], 1) + 1) >= 8 * b.nbytes:
        return dataclasses.replace(encode_full(new, kernels=k), changed=len(idx))
    result_hash = k.hash(b)
    body, n_escapes = _delta_body(idx, vals, b.shape[0], k)
    if body.nbytes >= b.nbytes:  # dense change: the raw tensor is smaller
        return dataclasses.replace(encode_full(new, kernels=k), changed=len(idx))
    body = k.to_host(body)
    flags, stored = 0, body
    if zstd_level is not None:
        packed = zstandard.ZstdCompressor(level=zstd_level).compress(body)
        if len(packed) < body.nbytes:
            flags, stored = ZSTD, np.frombuffer(packed, np.uint8)
    header = _header(DELTA, new, len(idx), n_escapes, body.nbytes, stored, result_hash, flags)
    return Encoded(header, stored, len(idx), False)


def copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src on the raw bits (any strides, same device; on CPU without torch's thread pool)."""
    _check_pair(dst, src)
    k = for_device(dst.device)
    _array(dst, k)[...] = _array(src, k)


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


def apply_into(target: torch.Tensor, header: bytes, body: np.ndarray, *,
               kernels: Kernels | None = None) -> int:
    """Apply one payload to `target` in place (any strides, any device) and verify the result's
    checksum; `kernels` as for `encode_full`.

    Returns the number of elements the payload carries. Header, checksum and index checks all
    run on the host before the first write; a result mismatch after writing means `target` was
    not the sender's baseline, and the caller needs a full sync.
    """
    h = _parse(header, body)
    _check_fits(h, target)
    k = kernels or for_device(target.device)
    if h.flags & ZSTD:
        body = _decompress(body, h.raw_len)
    if body.nbytes != h.raw_len:
        raise CorruptDelta(f"body is {body.nbytes} bytes, header says {h.raw_len}")
    if h.kind == FULL:
        if xxhash.xxh3_64(body).intdigest() != h.result_hash:
            raise CorruptDelta("payload checksum mismatch: full body corrupted in transit")
        _array(target, k)[...] = k.from_host(body.view(_np_int(target)).reshape(target.shape))
        return h.n_changed
    layout = _parse_delta(body, h.n_changed, h.n_escapes, target.numel(), target.element_size())
    if _in_place(target, k, lambda flat: _apply_delta(flat, k.from_host(body), layout, k)) != h.result_hash:
        raise CorruptDelta("result checksum mismatch: the tensor the delta was applied to is not the "
                           "sender's baseline; a full sync is needed")
    return h.n_changed


# ----------------------------------------------------------------------------------- internals


def _array(t: torch.Tensor, k: Kernels) -> Any:
    """The integer array of `k` sharing `t`'s memory (strided views stay strided)."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {t.dtype}; expected one of bfloat16, float16, float32")
    return k.array(t.detach().view(_DTYPES[t.dtype][1]))


def _np_int(t: torch.Tensor) -> type:
    return np.int16 if t.element_size() == 2 else np.int32


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype:
        raise ValueError(f"dtype mismatch: old is {old.dtype}, new is {new.dtype}")
    if old.shape != new.shape:
        raise ValueError(f"shape mismatch: old is {tuple(old.shape)}, new is {tuple(new.shape)}")
    if old.device != new.device:
        raise ValueError(f"device mismatch: old is on {old.device}, new on {new.device}")
    if new.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {new.dtype}; expected one of bfloat16, float16, float32")


def _in_place(t: torch.Tensor, k: Kernels, fn: Callable[[Any], _T]) -> _T:
    """`fn` of `t`'s raw bits as a flat array it may write to: a view of a contiguous tensor,
    else a copy written back afterwards."""
    raw = _array(t, k)
    flat = k.flat(raw)
    out = fn(flat)
    if not k.contiguous(raw):
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


def _delta_body(idx: Any, vals: Any, numel: int, k: Kernels) -> tuple[Any, int]:
    """The delta body (uint8, where `k` works) for sorted changed indices `idx` and their new
    bits `vals`; and its escape count."""
    n_chunks = -(-numel // CHUNK)
    # A gap costs at least one byte, so a chunk with more than CHUNK / 8 changes is smaller as
    # a bitmap; below that gaps win.
    is_bitmap = k.zeros(n_chunks, "bool")
    if len(idx) > CHUNK // 8:  # idx is sorted: count per chunk by bisection, not a pass over idx
        bounds = k.searchsorted(idx, k.arange(n_chunks + 1) << CHUNK_SHIFT)
        is_bitmap = bounds[1:] - bounds[:-1] > CHUNK // 8
    bitmap = k.zeros(0, "uint8")
    gap_idx = idx
    n_bitmaps = int(is_bitmap.sum())  # one read of a device's result, not two (any, then sum)
    if n_bitmaps:
        chunk = idx >> CHUNK_SHIFT
        in_bitmap = is_bitmap[chunk]
        bits = k.zeros(n_bitmaps * CHUNK, "bool")
        rank = is_bitmap.cumsum(0) - 1  # position of each bitmap chunk among the bitmaps
        bits[(rank[chunk[in_bitmap]] << CHUNK_SHIFT) | (idx[in_bitmap] & (CHUNK - 1))] = True
        bitmap = k.packbits(bits)
        gap_idx = idx[~in_bitmap]
        vals = k.cat([vals[in_bitmap], vals[~in_bitmap]])
    dist = k.diff(gap_idx, -1)
    escaped = dist > 255
    gaps = k.astype(dist, "uint8")
    gaps[escaped] = 0
    escapes = dist[escaped]
    # The low bytes of each int64 (little-endian): torch has no uint32 arithmetic.
    escape_bytes = k.view(escapes, "uint8").reshape(-1, 8)[:, :_escape_width(numel)].reshape(-1)
    parts = [escape_bytes, k.view(vals, "uint8"), k.view(is_bitmap, "uint8"), bitmap, gaps]
    return k.cat(parts), len(escapes)


def _escape_width(numel: int) -> int:
    return 4 if numel < 1 << 32 else 8


@dataclasses.dataclass(frozen=True)
class _DeltaLayout:
    """Where the fields of a delta body lie (the module docstring lists them)."""

    n_changed: int
    n_escapes: int
    escape_width: int  # bytes
    itemsize: int
    n_chunks: int
    n_bitmaps: int

    @property
    def gaps_at(self) -> int:
        return (self.n_escapes * self.escape_width + self.n_changed * self.itemsize + self.n_chunks
                + self.n_bitmaps * CHUNK // 8)

    def fields(self, body: Any, k: Kernels) -> tuple[Any, Any, Any, Any, Any]:
        """(escapes as int64, values, chunk kinds, bitmaps, gaps) of `body`, a byte array where `k` works."""
        vals_at = self.n_escapes * self.escape_width
        kinds_at = vals_at + self.n_changed * self.itemsize
        bitmaps_at = kinds_at + self.n_chunks
        escapes = k.astype(k.view(body[:vals_at], f"int{8 * self.escape_width}"), "int64")
        if self.escape_width == 4:  # uint32 on the wire, read as int32: torch has no uint32 arithmetic
            escapes &= 0xFFFFFFFF
        return (escapes, k.view(body[vals_at:kinds_at], f"int{8 * self.itemsize}"),
                body[kinds_at:bitmaps_at], body[bitmaps_at:self.gaps_at], body[self.gaps_at:])


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def _parse_delta(body: np.ndarray, n_changed: int, n_escapes: int, numel: int, itemsize: int) -> _DeltaLayout:
    """Checks a delta body against its header and the tensor before anything is written (on the
    host, whichever kernels apply it); returns where its fields lie."""
    n_chunks = -(-numel // CHUNK)
    width = _escape_width(numel)
    kinds_at = n_escapes * width + n_changed * itemsize
    if body.size < kinds_at + n_chunks:
        raise CorruptDelta(f"delta body of {body.size} bytes cannot hold its values and chunk kinds")
    kinds = body[kinds_at:kinds_at + n_chunks]
    if (kinds > 1).any():
        raise CorruptDelta("delta chunk kind out of range")
    layout = _DeltaLayout(n_changed, n_escapes, width, itemsize, n_chunks, int(np.count_nonzero(kinds)))
    escapes, _, _, bitmaps, gaps = layout.fields(body, NUMBA)
    n_gaps = n_changed - int(_POPCOUNT[bitmaps].sum(dtype=np.int64))
    need = layout.gaps_at + max(n_gaps, 0)
    if n_gaps < 0 or body.size != need:
        raise CorruptDelta(f"delta body is {body.size} bytes, its fields need {need}")
    if np.count_nonzero(gaps == 0) != n_escapes or (escapes <= 255).any() or (escapes > numel).any():
        raise CorruptDelta("delta gap escapes do not match their markers")
    # Every distance is at least 1, so positions rise and the last one bounds them all; only the
    # last chunk can be partial, so only its bitmap can reach past the end.
    last = int(gaps.sum(dtype=np.int64)) + int(escapes.sum()) - 1
    tail = numel % CHUNK
    past_end = tail and kinds[-1] and np.unpackbits(bitmaps[-CHUNK // 8:], bitorder="little")[tail:].any()
    if last >= numel or past_end:
        raise CorruptDelta(f"delta index out of range for a tensor of {numel} elements")
    return layout


def _apply_delta(flat: Any, body: Any, layout: _DeltaLayout, k: Kernels) -> int:
    """Writes a checked delta `body` (where `k` works) into `flat`; returns xxh3 of the result
    (hashed here, so that a strided tensor's flat copy serves the check too)."""
    escapes, vals, kinds, bitmaps, gaps = layout.fields(body, k)
    chunks, bits = k.flatnonzero(kinds), k.flatnonzero(k.unpackbits(bitmaps))
    flat[(chunks[bits >> CHUNK_SHIFT] << CHUNK_SHIFT) | (bits & (CHUNK - 1))] = vals[:len(bits)]
    k.scatter_gaps(flat, gaps, escapes, vals[len(bits):])
    return k.hash(flat)
