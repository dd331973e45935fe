"""Decode attention on the CPU that reads K and V in place in the pool's pages.

A decode has one query per sequence, so SDPA over gathered pages is bound by memory traffic:
the gather reads every page and writes a copy, SDPA reads the copy again. The kernel
(`csrc/cpu_attention.cpp`) reads each page once, where it lies, for all the query heads that
share its KV head (GQA), keys then values, eight keys at a time, prefetching the next page, and
runs the (sequence, KV head) pairs on PyTorch's own thread pool. CPU float32 only.

It is C++ because the numba kernel it replaced read K/V at about 12 GB/s on one thread or two
(docs/engine.md), and its OpenMP layer raised PyTorch's thread count. It is built on first use
(about 10 s) for this CPU and PyTorch, and cached. The build takes no lock: each process that
finds no build compiles to a file of its own and renames it into place, so a build killed
half-way leaves nothing that a later one waits for (PyTorch's JIT builder leaves a lock file).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the kernel's instantiations
# A parallel launch waits for every thread: 5 us more than one thread's on an idle machine, 130
# when another process holds a core (measured, one sequence of SmolLM2). One thread reads about
# 30 (context token x KV head) a microsecond from scattered pages, so below this much work it
# loses at most 35 us idle and saves the wait under load.
PARALLEL_MIN_WORK = 2048
# -march=native: built for this CPU. -ffast-math lets GCC vectorise exp; it is given to the
# compile step only, since linked in it would set the whole process's FPU to flush denormals.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
BUILD_TIMEOUT_S = 300


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def available(head_dim: int) -> bool:
    """Whether the kernel can run here: a head size it is built for and a C++ compiler."""
    return head_dim in HEAD_DIMS and compiler() is not None


def cache_dir() -> Path:
    """`ROSE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/rose/kernels` (~/.cache by default)."""
    if os.environ.get("ROSE_KERNEL_CACHE"):
        return Path(os.environ["ROSE_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rose" / "kernels"


def _cpu_features() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() + platform.machine()


def _build(cxx: str, target: Path) -> None:
    """Compile, then link (without -ffast-math), into a file of this process's, then rename it
    to `target` (atomic: a concurrent build of the same file only does the work twice)."""
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / target.name
        for command in ([cxx, *COMPILE_FLAGS, abi, *includes, "-c", str(SOURCE), "-o", str(obj)],
                        [cxx, "-shared", str(obj), *libraries, "-lc10", "-ltorch_cpu", "-o", str(lib)]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"building the CPU attention kernel failed ({command[0]}):\n"
                                   f"{done.stderr[-3000:]}\nattention_backend='sdpa' needs no build")
        os.replace(lib, target)


@functools.cache
def load() -> Path:
    """Build the kernel (or find its build) and load it into this process: once, before the
    first iteration, so that no request waits for a compile. Returns the library's path."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the CPU attention kernel needs a C++ compiler (c++, or $CXX): none found; "
                           "attention_backend='sdpa' needs none")
    key = "\n".join([SOURCE.read_text(), " ".join(COMPILE_FLAGS), cxx, torch.__version__,
                     str(Path(torch.__file__).parent), _cpu_features()])
    target = cache_dir() / f"cpu_attention-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if not target.exists():
        _build(cxx, target)
    torch.ops.load_library(str(target))
    return target


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
    seqs, heads, dim = q.shape
    kv_heads = pages.shape[0]
    q = q.contiguous().view(seqs, kv_heads, heads // kv_heads, dim)
    out = torch.empty_like(q)
    torch.ops.rose.paged_decode(q, rows, pages, offset, lengths, block_size, dim ** -0.5, threads, out)
    return out.view(seqs, heads, dim)
