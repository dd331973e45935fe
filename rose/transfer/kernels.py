"""The codec's per-device pieces, behind one interface (`Kernels`) so that `codec.py` writes the
wire format once: finding changed elements, scattering gap-coded ones, the few array primitives
numpy and torch spell differently, and moving bytes between the tensors and host memory.

- `NUMBA` (CPU tensors): numpy arrays sharing the tensors' memory and two compiled loops.
  numpy needs several passes and temporaries for each loop (compare, nonzero, gather; then
  cumsum and a fancy-index scatter), and at RL densities (0.6-5% of elements changed) those
  passes, not memory bandwidth, bound a sync on CPU. Each loop here is one pass. Both release
  the GIL, so the sync threads of senders and receivers run them in parallel.
- `TorchKernels(device)` (tensors on an accelerator): the same steps as torch ops on the device,
  so the weights never leave it; only payload bodies cross to the host, through pinned memory
  (and each tensor's bytes once, in slices, for its xxh3 checksum).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import numba
import numpy as np
import torch
import xxhash

Array = Any  # np.ndarray for NUMBA, torch.Tensor for TorchKernels
# Slices in which a device tensor is copied to the host for hashing: bounded pinned buffers.
HASH_SLICE_BYTES = 32 << 20
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Kernels(Protocol):
    def array(self, bits: torch.Tensor) -> Array:
        """The array these kernels work on, sharing the memory of `bits` (an integer view)."""

    def contiguous(self, a: Array) -> bool: ...

    def flat(self, a: Array) -> Array:
        """`a` in row-major order, 1-D: a view when contiguous, else a contiguous copy."""

    def changed(self, base: Array, new: Array, advance: bool) -> tuple[Array, Array]:
        """Sorted flat positions where the flat integer arrays differ (int64), and `new` there;
        with `advance`, `base` takes `new`'s values."""

    def scatter_gaps(self, flat: Array, gaps: Array, escapes: Array, vals: Array) -> None:
        """`flat[i_k] = vals[k]` where `i_k` advances by `gaps[k]` from -1, a gap of 0 taking the
        next of `escapes` (int64) instead; the positions are checked already."""

    def hash(self, flat: Array) -> int:
        """xxh3-64 of a contiguous array's bytes."""

    def to_host(self, a: Array) -> np.ndarray:
        """`a` as a host array: itself for numpy, else a copy."""

    def from_host(self, a: np.ndarray) -> Array:
        """`a` where these kernels work: itself for numpy, else a copy (any strides in, contiguous
        out, the integer type of the same width)."""

    def zeros(self, n: int, dtype: str) -> Array: ...
    def arange(self, n: int) -> Array: ...  # int64
    def searchsorted(self, a: Array, v: Array) -> Array: ...
    def diff(self, a: Array, prepend: int) -> Array: ...
    def cat(self, parts: Sequence[Array]) -> Array: ...
    def flatnonzero(self, a: Array) -> Array: ...  # int64
    def packbits(self, bits: Array) -> Array: ...  # little bit order; len(bits) % 8 == 0
    def unpackbits(self, a: Array) -> Array: ...  # little bit order, 0/1 as uint8
    def astype(self, a: Array, dtype: str) -> Array: ...
    def view(self, a: Array, dtype: str) -> Array: ...


class NumbaKernels:
    def array(self, bits: torch.Tensor) -> np.ndarray:
        return bits.numpy()

    def contiguous(self, a: np.ndarray) -> bool:
        return a.flags.c_contiguous

    def flat(self, a: np.ndarray) -> np.ndarray:
        # numpy's copy, single-threaded: torch's would wake its thread pool inside every sync thread.
        return np.ascontiguousarray(a).reshape(-1)

    def changed(self, base: np.ndarray, new: np.ndarray, advance: bool) -> tuple[np.ndarray, np.ndarray]:
        # The output buffers are sized for the worst case but only the entries written are
        # ever touched (and so backed by memory).
        lanes = 8 // base.itemsize
        words = base.size // lanes * lanes  # the elements in whole 8-byte words
        idx, vals = np.empty(base.size, np.int64), np.empty(base.size, base.dtype)
        k = find_changed(base, new, base[:words].view(np.uint64), new[:words].view(np.uint64), lanes, idx,
                         vals, advance)
        return idx[:k], vals[:k]

    def scatter_gaps(self, flat: np.ndarray, gaps: np.ndarray, escapes: np.ndarray, vals: np.ndarray) -> None:
        scatter_gaps(flat, gaps, escapes, vals)

    def hash(self, flat: np.ndarray) -> int:
        return xxhash.xxh3_64(flat.view(np.uint8)).intdigest()

    def to_host(self, a: np.ndarray) -> np.ndarray:
        return a

    def from_host(self, a: np.ndarray) -> np.ndarray:
        return a

    def zeros(self, n: int, dtype: str) -> np.ndarray:
        return np.zeros(n, dtype)

    def arange(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64)

    def searchsorted(self, a: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.searchsorted(a, v)

    def diff(self, a: np.ndarray, prepend: int) -> np.ndarray:
        return np.diff(a, prepend=prepend)

    def cat(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts)

    def flatnonzero(self, a: np.ndarray) -> np.ndarray:
        return np.flatnonzero(a)

    def packbits(self, bits: np.ndarray) -> np.ndarray:
        return np.packbits(bits, bitorder="little")

    def unpackbits(self, a: np.ndarray) -> np.ndarray:
        return np.unpackbits(a, bitorder="little")

    def astype(self, a: np.ndarray, dtype: str) -> np.ndarray:
        return a.astype(dtype)

    def view(self, a: np.ndarray, dtype: str) -> np.ndarray:
        return a.view(dtype)


class TorchKernels:
    """Torch ops on `device`; host copies go through pinned memory when it is a CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._bit = torch.arange(8, dtype=torch.uint8, device=device)

    def array(self, bits: torch.Tensor) -> torch.Tensor:
        return bits

    def contiguous(self, a: torch.Tensor) -> bool:
        return a.is_contiguous()

    def flat(self, a: torch.Tensor) -> torch.Tensor:
        if a.numel() <= 1:  # contiguous whatever its strides, but only stride 1 views as bytes
            return a.as_strided((a.numel(),), (1,))
        return a.contiguous().view(-1)

    def changed(self, base: torch.Tensor, new: torch.Tensor,
                advance: bool) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.flatnonzero(base != new)
        vals = new[idx]
        if advance:  # a dense copy: at device bandwidth cheaper than scattering the changes
            base.copy_(new)
        return idx, vals

    def scatter_gaps(self, flat: torch.Tensor, gaps: torch.Tensor, escapes: torch.Tensor,
                     vals: torch.Tensor) -> None:
        dist = gaps.to(torch.int64)
        dist[gaps == 0] = escapes
        flat[dist.cumsum(0) - 1] = vals

    def hash(self, flat: torch.Tensor) -> int:
        h = xxhash.xxh3_64()
        for part in flat.view(torch.uint8).split(HASH_SLICE_BYTES):
            h.update(self.to_host(part))
        return h.intdigest()

    def to_host(self, a: torch.Tensor) -> np.ndarray:
        host = torch.empty(a.shape, dtype=a.dtype, pin_memory=self.pinned)
        host.copy_(a, non_blocking=self.pinned)
        if self.pinned:  # the DMA must land before the host reads the buffer
            torch.cuda.current_stream(self.device).synchronize()
        return host.numpy()

    def from_host(self, a: np.ndarray) -> torch.Tensor:
        staged = torch.empty(a.shape, dtype=_TORCH_INT[a.itemsize], pin_memory=self.pinned)
        staged.numpy()[...] = a
        # The caching host allocator keeps `staged` from reuse until this copy has run.
        return staged.to(self.device, non_blocking=self.pinned)

    def zeros(self, n: int, dtype: str) -> torch.Tensor:
        return torch.zeros(n, dtype=getattr(torch, dtype), device=self.device)

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=self.device)

    def searchsorted(self, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(a, v)

    def diff(self, a: torch.Tensor, prepend: int) -> torch.Tensor:
        return torch.diff(a, prepend=torch.full((1,), prepend, dtype=a.dtype, device=a.device))

    def cat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts))

    def flatnonzero(self, a: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(a.reshape(-1)).view(-1)

    def packbits(self, bits: torch.Tensor) -> torch.Tensor:
        return (bits.view(-1, 8).to(torch.uint8) << self._bit).sum(1).to(torch.uint8)

    def unpackbits(self, a: torch.Tensor) -> torch.Tensor:
        return ((a.unsqueeze(1) >> self._bit) & 1).view(-1)

    def astype(self, a: torch.Tensor, dtype: str) -> torch.Tensor:
        return a.to(getattr(torch, dtype))

    def view(self, a: torch.Tensor, dtype: str) -> torch.Tensor:
        return a.view(getattr(torch, dtype))


NUMBA = NumbaKernels()


@functools.cache
def torch_kernels(device: torch.device) -> TorchKernels:
    return TorchKernels(device)


def for_device(device: torch.device) -> Kernels:
    """numba for CPU tensors (the fastest there), torch ops on the device for any other."""
    return NUMBA if device.type == "cpu" else torch_kernels(device)


@numba.njit(nogil=True, cache=True)
def find_changed(base: np.ndarray, new: np.ndarray, base_words: np.ndarray, new_words: np.ndarray,
                 lanes: int, idx: np.ndarray, vals: np.ndarray, advance: bool) -> int:
    """Writes the flat positions where `base` and `new` (same-width integer views) differ, in
    order, to `idx` and `new`'s values there to `vals` (both at least `base.size` long); returns
    how many. `*_words` are the same arrays' leading whole 8-byte words, of `lanes` (4 or 2)
    elements each (views made by the caller: numba's own views index slower). With `advance`,
    `base` takes `new`'s values too.

    Compares words first (most are equal at RL densities) and stores branch-free inside a word
    that differs: the position is always written and the count moves on only on a change.
    """
    k = 0
    for w in range(base_words.size):
        if base_words[w] != new_words[w]:
            for j in range(4):  # a constant trip count, unrolled: 1.4x faster than range(lanes)
                if j < lanes:
                    i = w * lanes + j
                    idx[k] = i
                    vals[k] = new[i]
                    k += base[i] != new[i]
            if advance:
                base_words[w] = new_words[w]
    for i in range(base_words.size * lanes, base.size):
        idx[k] = i
        vals[k] = new[i]
        k += base[i] != new[i]
        if advance:
            base[i] = new[i]
    return k


@numba.njit(nogil=True, cache=True)
def scatter_gaps(target: np.ndarray, gaps: np.ndarray, escapes: np.ndarray, vals: np.ndarray) -> None:
    """`target[i_k] = vals[k]` where `i_k` advances by `gaps[k]` from -1, a gap of 0 taking the
    next of `escapes` (int64: an unsigned one would make the position a float) instead. The
    caller has checked that the positions stay in range."""
    pos, e = -1, 0
    for k in range(gaps.size):
        g = gaps[k]
        if g == 0:
            pos += escapes[e]
            e += 1
        else:
            pos += g
        target[pos] = vals[k]
