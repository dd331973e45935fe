"""Attention on the CPU that reads K and V in place in the pool's pages (CPU float32 only).

A decode has one query per sequence, so SDPA over gathered pages is bound by memory traffic:
the gather reads every page and writes a copy, SDPA reads the copy again. The decode kernel
(`csrc/cpu_attention.cpp`) reads each page once, where it lies, for all the query heads that
share its KV head (GQA), keys then values, eight keys at a time, prefetching the next page, and
runs the (sequence, KV head) pairs on PyTorch's own thread pool. It is C++ because the numba
kernel it replaced read K/V at about 12 GB/s on one thread or two (docs/engine.md), and its
OpenMP layer raised PyTorch's thread count.

A prefill chunk is bound by arithmetic instead, where PyTorch's CPU SDPA ran at about 20 GFLOP/s
on one core (8 ms per layer for 512 tokens of SmolLM2). The prefill kernel takes tiles of 16
queries (times the heads of a KV head) against tiles of 16 keys, transposed so that each FMA is a
full vector, with flash attention's online softmax, reading the prefix and the chunk's own K/V
where they lie. `cpu_kernels` builds both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rose.engine import cpu_kernels

HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the kernel's instantiations
# A parallel launch waits for every thread: 5 us more than one thread's on an idle machine, 130
# when another process holds a core (measured, one sequence of SmolLM2). One thread reads about
# 30 (context token x KV head) a microsecond from scattered pages, so below this much work it
# loses at most 35 us idle and saves the wait under load.
PARALLEL_MIN_WORK = 2048


def available(head_dim: int) -> bool:
    """Whether the kernel can run here: a head size it is built for and a C++ compiler."""
    return head_dim in HEAD_DIMS and cpu_kernels.compiler() is not None


def threads_for(context_tokens: int, kv_heads: int) -> int:
    """The threads one call runs on: all of PyTorch's, unless the work is too small to share."""
    return torch.get_num_threads() if context_tokens * kv_heads >= PARALLEL_MIN_WORK else 1


def paged_decode(q: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, offset: int,
                 lengths: torch.Tensor, block_size: int, threads: int) -> torch.Tensor:
    """Attention of `q` `[seqs, heads, D]` (one query each, longest context first) over its
    sequence's pages; returns `[seqs, heads, D]`. rows: the pool's `[rows, block_size * D]`;
    pages `[kv_heads, seqs, width]`: each page's K row for layer 0 (`offset` moves it to this
    layer; its V row follows `kv_heads` rows later); lengths `[seqs]`: tokens attended to;
    threads: `threads_for` them, decided once per iteration, not per layer."""
    return _by_kv_head(torch.ops.rose.paged_decode, q, rows, pages, offset, lengths, block_size, threads)


def paged_prefill(q: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, offset: int, start: int,
                  block_size: int, threads: int) -> torch.Tensor:
    """Causal attention of one sequence's chunk `q` `[n, heads, D]` at positions `start ..
    start + n - 1` over its pages (its K/V already stored there); returns `[n, heads, D]`.
    pages `[kv_heads, width]`: the K rows for layer 0, as `paged_decode`'s."""
    return _by_kv_head(torch.ops.rose.paged_prefill, q, rows, pages, offset, start, block_size, threads)


def _by_kv_head(op: Callable[..., None], q: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor,
                offset: int, where: torch.Tensor | int, block_size: int, threads: int) -> torch.Tensor:
    """Run `op` on `q` viewed as `[tokens, kv_heads, group, D]` (the query heads of a KV head
    side by side, as GQA groups them) into a new output of that shape; return it as `q`'s."""
    tokens, heads, dim = q.shape
    kv_heads = pages.shape[0]
    grouped = q.contiguous().view(tokens, kv_heads, heads // kv_heads, dim)
    out = torch.empty_like(grouped)
    op(grouped, rows, pages, offset, where, block_size, dim ** -0.5, threads, out)
    return out.view(tokens, heads, dim)
