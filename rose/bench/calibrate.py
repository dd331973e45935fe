"""Measure the constants of the simulator's `cpu` device on this machine (one core, one torch thread).

`python -m rose.bench.calibrate` prints what `rose/sim/costs.py` and `rose/sim/workloads.py`
hold for `cpu`:
- each engine's iteration time as a linear model (fixed + per token + per cached token),
  fitted to the per-iteration minima of three identical runs (the minimum drops the time other
  processes on the shared machine took): `rose bench train`'s tiny models and `rose bench
  coserve`'s small ones;
- the CPU one streamed chunk (one generated token of one turn) costs a Ray actor and the
  driver (the rollout manager's process), 16 turns in flight, as a dedicated worker streams;
- the shape of `rose bench train`'s rollout (prompt, observation and reply tokens, turns) and
  the time an environment step takes, from the same episodes on one engine;
- the trainer's step over those trajectories, as achieved FLOP/s.
Nothing here runs `rose bench train` or uses its results.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rose.bench.train import bench_config
from rose.coserve.latency import nonnegative_lstsq
from rose.engine import LLMEngine, SamplingParams
from rose.model import init_model, load_tokenizer
from rose.rl import Episode, Objective, Trainer, TrainerConfig, make_env
from rose.runtime.config import Config, trainer_options
from rose.runtime.devices import init_ray
from rose.sim.costs import MODELS

REPEATS = 3
CPU = "cpu"  # the simulator's `cpu` device, wherever CUDA is also at hand


def engine_fit(path: Path) -> np.ndarray:
    """(fixed s, s per token, s per cached token read) of one engine iteration."""
    batches = [(b, p) for b in (1, 4, 16, 32, 64) for p in (64, 256, 512)]
    runs = []
    for _ in range(REPEATS):
        engine = LLMEngine.from_pretrained(path, device=CPU, kv_cache_bytes=64 << 20)
        steps = []
        for b, p in batches:
            prompts = [np.random.default_rng(b * p).integers(10, 500, p).tolist() for _ in range(b)]
            for i, prompt in enumerate(prompts):
                engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True, seed=i))
            while engine.has_unfinished():
                engine.step()
                steps.append(engine.last_step)
        runs.append(steps)
    x = np.array([[1.0, st.load.prefill_tokens + st.load.decode_seqs, st.load.context_tokens]
                  for st in runs[0]])
    y = np.min([[st.seconds for st in steps] for steps in runs], axis=0)
    return nonnegative_lstsq(x, y)  # the executor's latency model's fitter: times only grow with load


def ray_chunk_cpu_s() -> tuple[float, float]:
    """CPU seconds one streamed chunk costs the driver and the streaming actor, 16 turns of 24
    chunks in flight (the least of three runs)."""
    import ray

    init_ray(num_cpus=2)

    @ray.remote(num_cpus=0, max_concurrency=1000)
    class Streamer:
        def cpu(self) -> float:
            return time.process_time()

        async def stream(self, n: int):
            for i in range(n):
                await asyncio.sleep(0)
                yield [i], [0.0], [0], None

    async def turn(actor, n: int) -> None:
        async for ref in actor.stream.remote(n):
            await ref

    async def measure() -> tuple[float, float]:
        actor = Streamer.remote()
        await turn(actor, 4)
        driver, worker = [], []
        for _ in range(REPEATS):
            a0, d0 = await actor.cpu.remote(), time.process_time()
            await asyncio.gather(*[turn(actor, 24) for _ in range(16)])
            d1, a1 = time.process_time(), await actor.cpu.remote()
            driver.append((d1 - d0) / (16 * 24))
            worker.append((a1 - a0) / (16 * 24))
        return min(driver), min(worker)

    try:
        return asyncio.run(measure())
    finally:
        ray.shutdown()


def workload_and_trainer(policy: Path, config: Config) -> None:
    tok, r = load_tokenizer(policy), config.rollout
    engine = LLMEngine.from_pretrained(policy, device=CPU, kv_cache_bytes=r.kv_cache_mb << 20)
    trainer = Trainer(policy, Objective.grpo(), TrainerConfig(**{**trainer_options(config), "device": CPU}))
    params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature,
                            stop_token_ids=tuple(tok.stop_token_ids))
    env_s, train_s, tokens, trajs = [], [], [], []
    for step in range(REPEATS):
        episodes = [Episode(make_env(config.env.name, **config.env.options), tok, seed=step * r.groups + g,
                            group_id=(step, g), max_context_tokens=r.max_context_tokens)
                    for g in range(r.groups) for _ in range(r.group_size)]
        while active := [e for e in episodes if not e.done]:
            for episode, out in zip(active, engine.generate([e.prompt_ids for e in active], params),
                                    strict=True):
                t0 = time.perf_counter()
                episode.record(out.token_ids, out.logprobs, out.versions)
                env_s.append(time.perf_counter() - t0)
        step_trajs = [e.trajectory for e in episodes]
        t0 = time.perf_counter()
        trainer.step(step_trajs)
        train_s.append(time.perf_counter() - t0)
        tokens.append(sum(len(u.prompt_ids) + len(u.output_ids) for tr in step_trajs for u in tr.turns))
        trajs += step_trajs
    turns = np.array([len(tr.turns) for tr in trajs])
    print(f"first prompt tokens {np.mean([len(tr.turns[0].prompt_ids) for tr in trajs]):.1f}")
    print(f"observation tokens per later turn "
          f"{np.mean([len(u.prompt_ids) for tr in trajs for u in tr.turns[1:]]):.1f}")
    replies = [len(u.output_ids) for tr in trajs for u in tr.turns]
    print(f"reply tokens: median {np.median(replies):.0f}, mean {np.mean(replies):.2f}")
    cap = config.env.options["max_turns"]
    print(f"turns: mean {turns.mean():.2f}, share ending before {cap}: {np.mean(turns < cap):.3f}")
    print(f"environment step (record a reply) median {statistics.median(env_s) * 1e3:.3f} ms")
    best = int(np.argmin(train_s))
    flops = (6 + 2 * 2) * MODELS["tiny-qwen3"].params * tokens[best]   # GRPO: 2 log-prob passes
    print(f"trainer step: best {train_s[best]:.3f} s for {tokens[best]} tokens = {flops / train_s[best]:.3e} "
          f"FLOP/s achieved (all: {', '.join(f'{s:.2f}' for s in train_s)} s)")


def main() -> None:
    torch.set_num_threads(1)
    config = bench_config()
    with tempfile.TemporaryDirectory() as tmp:
        policy = config.model.checkpoint(Path(tmp) / "policy")
        serving = config.serving.model.checkpoint(Path(tmp) / "serving")
        # `rose bench coserve`'s models (`default_models`): the `cpu-bench-burst` scenario's.
        small = {f"small {arch}": init_model(arch, "small", Path(tmp) / arch, seed=seed)
                 for arch, seed in (("qwen3", 2), ("qwen2", 1))}
        for label, path in (("policy", policy), ("serving", serving), *small.items()):
            fixed, per_token, per_ctx = engine_fit(path)
            print(f"{label} engine iteration: fixed {fixed * 1e3:.3f} ms, per token "
                  f"{per_token * 1e6:.2f} us, per cached token {per_ctx * 1e9:.1f} ns")
        workload_and_trainer(policy, config)
    driver, worker = ray_chunk_cpu_s()
    print(f"Ray streamed chunk, CPU: driver {driver * 1e3:.3f} ms, streaming actor {worker * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
