"""The paged attention's backends (C++ in place on the CPU, gather + SDPA, Triton) against plain math."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_cases import BATCHES, check_backend

from rose.cli import main
from rose.engine import cpu_attention, cpu_kernels
from rose.engine.attention import BACKENDS, PagedAttention
from rose.engine.kv_pool import KVPool, KVSpec


@pytest.mark.parametrize(("backend", "batch"), [  # long decodes take Triton's interpreter 45 s
    (backend, batch) for backend in BACKENDS for batch in BATCHES
    if (backend, batch) not in {("triton", "long-decodes"), ("triton", "long-prefills")}])
def test_attention_reads_each_sequences_pages(backend: str, batch: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("with CUDA the Triton kernel runs compiled, in the gpu tests")
    if batch == "long-decodes":
        assert cpu_attention.threads_for(sum(c + n for c, n in BATCHES[batch]), 2) == torch.get_num_threads()
    check_backend(backend, batch)


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (80, 12)])
def test_cpu_kernel_at_model_sizes(head_dim: int, block_size: int) -> None:
    """Head sizes of real models, with pages of whole tiles of eight keys (16) or a tile and a
    tail (12), contexts ending mid-tile."""
    for batch in ("long-decodes", "mixed", "long-prefills"):
        check_backend("cpu", batch, block_size=block_size, head_dim=head_dim)


def test_cpu_kernel_leaves_the_thread_count_and_fpu_mode_alone() -> None:
    """The numba kernel it replaced raised PyTorch's thread count from 1 to 2 on its first launch
    (their OpenMP runtimes are one library); -ffast-math linked in would flush denormals."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_backend("cpu", "long-decodes")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0


def test_cpu_kernel_builds_concurrently_without_a_lock(tmp_path: Path) -> None:
    """Two processes building into an empty cache both load the kernel, and leave one build and
    no half-written files; a compiler that fails gives an error that names the way out."""
    env = {**os.environ, "ROSE_KERNEL_CACHE": str(tmp_path)}
    code = "from rose.engine import cpu_kernels; print(cpu_kernels.load())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    paths = {proc.communicate(timeout=600)[0].strip() for proc in procs}
    assert [proc.returncode for proc in procs] == [0, 0]
    assert [str(p) for p in tmp_path.iterdir()] == list(paths)
    with pytest.raises(RuntimeError, match="attention_backend='sdpa' needs no build"):
        cpu_kernels._build("false", tmp_path / "broken.so")
    assert not (tmp_path / "broken.so").exists() and len(list(tmp_path.iterdir())) == 1


def test_cpu_kernel_refuses_indices_outside_the_pool() -> None:
    """A page row past the pool's end or a context longer than its pages raises, not reads
    memory the pool does not own."""
    cpu_kernels.load()
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
    pool = KVPool.for_specs(8 * spec.block_bytes, spec)
    rows, q = pool.rows(spec), torch.randn(1, 4, 16)
    pages, lengths = torch.zeros(2, 1, 2, dtype=torch.long), torch.tensor([8])
    assert cpu_attention.paged_decode(q, rows, pages, 0, lengths, 4, 1).isfinite().all()
    with pytest.raises(RuntimeError, match="outside the pool's 64 rows"):
        cpu_attention.paged_decode(q, rows, pages + 63, 0, lengths, 4, 1)
    with pytest.raises(RuntimeError, match="attends to 9 tokens; its 2 pages hold 1 to 8"):
        cpu_attention.paged_decode(q, rows, pages, 0, torch.tensor([9]), 4, 1)
    chunk, prefill_pages = torch.randn(3, 4, 16), pages[:, 0]
    assert cpu_attention.paged_prefill(chunk, rows, prefill_pages, 0, 5, 4, 1).isfinite().all()
    with pytest.raises(RuntimeError, match="outside the pool's 64 rows"):
        cpu_attention.paged_prefill(chunk, rows, prefill_pages + 63, 0, 5, 4, 1)
    with pytest.raises(RuntimeError, match="a chunk of 3 tokens from 6 does not fit its 2 pages of 4"):
        cpu_attention.paged_prefill(chunk, rows, prefill_pages, 0, 6, 4, 1)


def test_the_triton_kernel_compiles_for_the_gpu() -> None:
    """No GPU here: Triton's own compiler takes the kernel to a Hopper cubin, in float32 and
    bfloat16, decode and prefill tiles, several models' shapes (tests/triton_compile.py)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "triton_compile.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_an_unknown_backend_is_refused() -> None:
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="attention backend 'flash'"):
        PagedAttention(KVPool.for_specs(8 * spec.block_bytes, spec), spec, num_heads=1, backend="flash")
    odd = KVSpec(num_layers=1, num_kv_heads=1, head_dim=24, block_size=4)
    with pytest.raises(ValueError, match=r"head_dim one of .* head_dim 24"):
        PagedAttention(KVPool.for_specs(8 * odd.block_bytes, odd), odd, num_heads=1, backend="cpu")
    assert PagedAttention(KVPool.for_specs(8 * odd.block_bytes, odd), odd, num_heads=1).backend == "sdpa"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_profile_accounts_for_each_iteration(ckpt: Path, tmp_path: Path, dtype: str) -> None:
    """`rose bench profile` names where a decode and a prefill iteration spend their time: in
    float32 the fused forward's steps and the in-place kernels, in bfloat16 the model's own ops,
    the page gathers and SDPA."""
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--model", str(ckpt), "--batch", "4", "--context", "40",
                 "--chunk", "64", "--iterations", "2", "--threads", "1", "--dtype", dtype,
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    decode, prefill = report["decode"], report["prefill"]
    for parts in (decode, prefill):
        assert parts["wall_ms"] > 0 and all(ms >= 0 for ms in parts.values())
        assert {"matmuls", "LM head", "sampling"} <= parts.keys()
        assert ({"norms (with residual adds)", "rope (with KV writes)", "SiLU x up"} <= parts.keys()) == (
            dtype == "float32")
        assert ({"norms", "rope", "KV writes"} <= parts.keys()) == (dtype != "float32")
    assert ("in-place decode attention" in decode) == (dtype == "float32")
    assert ("page gathers" in decode) == (dtype != "float32")
    assert ("in-place prefill attention" in prefill) == (dtype == "float32")
    assert ("SDPA" in prefill) == (dtype != "float32") and report["summary"]["decode_tokens_per_s"] > 0
