"""vLLM's CPU build as a benchmark peer: `python -m rose.bench.vllm_peer JOB.json`.

Run in its own process (vLLM must start under `__main__`); reads the model, prompts (token ids)
and output lengths from the job file and writes its throughput on them, and its batch-1 decode
(the first prompt's first 32 tokens, 128 new ones, as `rose.bench.engine.batch1`), to
`JOB.out.json`. Its KV cache is the job's `kv_cache_bytes`, the size ROSE's engine runs with.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rose.bench.engine import batch1
from rose.engine.vllm_engine import engine_args, max_model_len
from rose.model import ModelConfig


def main(job_file: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    job = json.loads(Path(job_file).read_text())
    dtype, kv_cache_bytes = job["dtype"], job["kv_cache_bytes"]
    llm = LLM(**engine_args(job["model"], dtype, kv_cache_bytes),
              max_model_len=max_model_len(ModelConfig.from_dir(job["model"]), dtype, kv_cache_bytes))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in job["outputs"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    one = [TokensPrompt(prompt_token_ids=job["prompts"][0][:32])]

    def generate_one(k: int) -> None:
        llm.generate(one, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True), use_tqdm=False)

    result = {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
              "batch1_tokens_per_s": batch1(generate_one)}
    Path(job_file).with_suffix(".out.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
