"""`rose bench profile`: where one engine iteration's time goes.

Two iterations are profiled with `torch.profiler` on a warm engine: a decode step of `--batch`
sequences at `--context` tokens each, and one prefill chunk of `--chunk` tokens. Every PyTorch op's
own time is charged to a part of the iteration: the matmuls, the attention's KV writes, page
gathers and SDPA (or the in-place decode kernel), the norms, RoPE, the LM head, sampling,
scheduling and the attention plan (these found by wrapping the functions that do them while the
profile runs; a scope's time between its ops, Python's, is charged to it too). What no scope or
op accounts for of the iteration's wall time (measured without the profiler) is Python between
them: module calls, building inputs, the engine's bookkeeping.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rose.bench import checkpoint_arg
from rose.engine import LLMEngine, SamplingParams, cpu_attention, llm_engine
from rose.engine.attention import PagedAttention
from rose.engine.scheduler import Scheduler
from rose.model import decoder, init_model
from rose.model.device import add_device_arguments, resolve
from rose.reporting import write_report

# The labelled scopes: (owner, attribute) wrapped in record_function(label) while profiling.
_SCOPES = (
    (llm_engine, "sample", "sampling"),
    (Scheduler, "schedule", "scheduling"),
    (PagedAttention, "prepare", "attention plan"),
    (PagedAttention, "__call__", "attention"),
    (PagedAttention, "attend", "attention"),
    (cpu_attention, "paged_decode", "in-place decode attention"),
    (cpu_attention, "paged_prefill", "in-place prefill attention"),
    (decoder.RMSNorm, "forward", "norms"),
    (decoder.RotaryEmbedding, "forward", "rope"),
    (decoder, "apply_rotary", "rope"),
)
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
            "mkldnn::_linear_pointwise"}
# The fused forward's C++ steps (rose/engine/fused_forward.py), each standing for several parts.
_FUSED_OPS = {"rose::add_rms_norm": "norms (with residual adds)", "rose::rope_store": "rope (with KV writes)",
              "rose::silu_mul": "SiLU x up"}
_ATTENTION_OPS = {"aten::index_put_": "KV writes", "aten::index_select": "page gathers"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF-format checkpoint (default: a fresh qwen3 `small`)")
    p.add_argument("--batch", type=int, default=32, help="decoding sequences (default 32)")
    p.add_argument("--context", type=int, default=256, help="their context length (default 256)")
    p.add_argument("--chunk", type=int, default=512, help="the prefill chunk's tokens (default 512)")
    p.add_argument("--iterations", type=int, default=20, help="profiled iterations of each kind")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--json", help="write the full report here")
    add_device_arguments(p)


@contextlib.contextmanager
def _labelled_scopes(engine: LLMEngine) -> Iterator[None]:
    """Wrap each scope's function (and this engine's LM head) so that the profile names it;
    put them back after."""
    saved = []
    for owner, name, label in (*_SCOPES, (engine.runner, "lm_head", "LM head")):
        fn = getattr(owner, name)
        saved.append((owner, name, vars(owner).get(name)))

        def wrapped(*args: object, __fn: Callable = fn, __label: str = label, **kwargs: object) -> object:
            with record_function(__label):
                return __fn(*args, **kwargs)

        setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            if fn is None:
                delattr(owner, name)  # an instance's method: the class's shows through again
            else:
                setattr(owner, name, fn)


def _part(op: str, scope: str | None) -> str:
    if op == scope:  # a scope's own time, between its ops
        return "attention (other ops)" if scope == "attention" else scope
    if scope == "attention":
        return _ATTENTION_OPS.get(op, "SDPA" if "attention" in op else "attention (other ops)")
    if scope is not None:
        return scope
    if op in _FUSED_OPS:
        return _FUSED_OPS[op]
    return "matmuls" if op in _MATMULS else "other ops (embedding, SiLU, residual adds, views)"


def _breakdown(prof: profile, wall_ms: float, iterations: int) -> dict[str, float]:
    """ms per iteration for each part; "python and other overhead": wall time no scope or op
    accounts for."""
    labels = {label for _, _, label in _SCOPES} | {"LM head"}
    parts: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.name in labels:
            parts[_part(event.name, event.name)] += event.self_cpu_time_total / 1000 / iterations
            continue
        if not event.name.startswith(("aten::", "mkldnn::", "rose::")):  # rose:: the C++ kernel
            continue
        scope, parent = None, event.cpu_parent
        while parent is not None and scope is None:  # the innermost labelled scope
            scope = parent.name if parent.name in labels else None
            parent = parent.cpu_parent
        parts[_part(event.name, scope)] += event.self_cpu_time_total / 1000 / iterations
    ops = sum(parts.values())
    parts["python and other overhead"] = max(0.0, wall_ms - ops)
    return {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}


def _profile(engine: LLMEngine, step: Callable[[], object], iterations: int) -> dict[str, float]:
    for _ in range(3):
        step()  # warm: buffers grown, kernels chosen
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    wall_ms = (time.perf_counter() - start) * 1000 / iterations
    with _labelled_scopes(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iterations):
            step()
    return {"wall_ms": round(wall_ms, 3), **_breakdown(prof, wall_ms, iterations)}


def _decode_step(engine: LLMEngine, batch: int, context: int, vocab: int) -> Callable[[], object]:
    """An engine with `batch` sequences past their prefill at `context` tokens: each call runs
    one decode iteration of all of them (their budget of tokens is never reached)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True))
    while any(s.num_uncomputed > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine.step


def _prefill_step(engine: LLMEngine, chunk: int, vocab: int) -> Callable[[], object]:
    """Each call: one fresh `chunk`-token prompt prefilled in one iteration, then dropped."""
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        prompt = torch.randint(0, vocab, (chunk,), generator=gen).tolist()
        rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        engine.step()
        engine.abort(rid)

    return step


def run(args: argparse.Namespace) -> int:
    device, dtype = resolve(args.device, args.dtype)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (checkpoint_arg("--model", args.model) if args.model
                     else init_model("qwen3", "small", Path(tmp) / "m"))
        config = {"dtype": dtype, "device": device, "kv_cache_bytes": args.kv_cache_mb << 20,
                  "chunk_size": args.chunk, "max_num_batched_tokens": max(args.chunk, args.batch)}
        engine = LLMEngine.from_pretrained(model_dir, **config)
        vocab = engine.vocab_size
        decode = _profile(engine, _decode_step(engine, args.batch, args.context, vocab), args.iterations)
        engine = LLMEngine.from_pretrained(model_dir, **config)
        prefill = _profile(engine, _prefill_step(engine, args.chunk, vocab), args.iterations)
    summary = {"decode_ms": decode["wall_ms"],
               "decode_tokens_per_s": round(args.batch / decode["wall_ms"] * 1000, 1),
               "prefill_ms": prefill["wall_ms"],
               "prefill_tokens_per_s": round(args.chunk / prefill["wall_ms"] * 1000, 1)}
    for name, parts in (("decode", decode), ("prefill", prefill)):
        print(f"{name}: {parts['wall_ms']:.2f} ms per iteration")
        for part, ms in parts.items():
            if part != "wall_ms":
                print(f"  {part:<50} {ms:8.3f} ms  {100 * ms / parts['wall_ms']:5.1f}%")
    write_report(args.json, summary, workload={
        "model": args.model or "qwen3 small (random)", "batch": args.batch, "context": args.context,
        "chunk": args.chunk, "iterations": args.iterations, "threads": args.threads,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "load_average": os.getloadavg()[0]}, decode=decode, prefill=prefill)
    return 0
