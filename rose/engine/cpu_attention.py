"""Decode attention on the CPU that reads K and V in place in the pool's pages.

A decode has one query per sequence, so SDPA over gathered pages is bound by memory traffic:
the gather reads every page and writes a copy, SDPA reads the copy again. The kernel
(`csrc/cpu_attention.cpp`) reads each page once, where it lies, for all the query heads that
share its KV head (GQA), keys then values, eight keys at a time, prefetching the next page, and
runs the (sequence, KV head) pairs on PyTorch's own thread pool. CPU float32 only.

It is C++ because the numba kernel it replaced read K/V at about 12 GB/s on one thread or two,
against the 27 / 36 GB/s this machine streams (docs/engine.md). PyTorch's extension builder
compiles it on first use (about 10 s, a C++ compiler and ninja needed) and caches the build.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the kernel's instantiations
# A parallel launch waits for every thread: 5 us more than one thread's on an idle machine, 130
# when another process holds a core (measured, one sequence of SmolLM2). One thread reads about
# 20 (context token x KV head) a microsecond, so below this much work it loses at most 50 us
# idle and saves the wait under load.
PARALLEL_MIN_WORK = 2048


def available(head_dim: int) -> bool:
    """Whether the kernel can run here: a head size it is built for and a C++ compiler."""
    return head_dim in HEAD_DIMS and shutil.which(os.environ.get("CXX", "c++")) is not None


def _cpu_tag() -> str:
    """A short tag of this CPU's model and features: the build targets this CPU (-march=native),
    and a build cache shared by different machines keeps one build per kind of CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        described = next(line for line in info.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        described = platform.processor() + platform.machine()
    return hashlib.sha256(described.encode()).hexdigest()[:12]


@functools.cache
def load() -> None:
    """Build the kernel (or find it in the cache) and load it into this process: once, before
    the first iteration, so that no request waits for a compile."""
    from torch.utils.cpp_extension import load

    # -fopenmp: ATen's parallel_for is OpenMP in PyTorch's CPU builds; -ffast-math only compiles
    # (it lets GCC vectorise exp), it is not on the link line, so it leaves the FPU mode alone.
    load(name=f"rose_cpu_attention_{_cpu_tag()}", sources=[str(SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"])


def paged_decode(q: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, offset: int,
                 lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention of `q` `[seqs, heads, D]` (one query each, longest context first) over its
    sequence's pages; returns `[seqs, heads, D]`. rows: the pool's `[rows, block_size * D]`;
    pages `[kv_heads, seqs, width]`: each page's K row for layer 0 (`offset` moves it to this
    layer; its V row follows `kv_heads` rows later); lengths `[seqs]`: tokens attended to."""
    seqs, heads, dim = q.shape
    kv_heads = pages.shape[0]
    q = q.contiguous().view(seqs, kv_heads, heads // kv_heads, dim)
    out = torch.empty_like(q)
    work = int(lengths.sum()) * kv_heads
    threads = torch.get_num_threads() if work >= PARALLEL_MIN_WORK else 1
    torch.ops.rose.paged_decode(q, rows, pages, offset, lengths, block_size, dim ** -0.5, threads, out)
    return out.view(seqs, heads, dim)
