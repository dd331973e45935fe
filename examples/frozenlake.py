"""The FrozenLake recipe of docs/rl.md as a plain library loop, one line per step.

    .venv/bin/python examples/frozenlake.py --seed 3                      # the recipe
    .venv/bin/python examples/frozenlake.py --seed 3 --lr-decay-steps 0   # constant lr

Every figure of docs/rl.md's recipe comparison came from this loop (one thread, one seed per
run: the policy's initial weights and every sampling seed derive from it, so a run repeats
exactly).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from rose.engine import LLMEngine, SamplingParams
from rose.model import init_model, load_tokenizer
from rose.rl import Episode, Objective, Trainer, TrainerConfig, make_env, run_episodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mini-batches", type=int, default=4)
    p.add_argument("--lr-decay-steps", type=int, default=100, help="cosine decay horizon (0: constant lr)")
    p.add_argument("--unscaled", action="store_true", help="Dr. GRPO advantages (no division by the std)")
    p.add_argument("--step-advantage-weight", type=float, default=0.0, help="GiGPO's omega")
    p.add_argument("--discount", type=float, default=0.95, help="GiGPO's gamma")
    args = p.parse_args()

    torch.set_num_threads(1)
    path = init_model("qwen3", "tiny", tempfile.mkdtemp(prefix="rose-frozenlake-"), seed=args.seed)
    tok = load_tokenizer(path)
    engine = LLMEngine.from_pretrained(path, kv_cache_bytes=64 * 1024**2)
    objective = Objective.grpo(scale_advantages=not args.unscaled, discount=args.discount,
                               step_advantage_weight=args.step_advantage_weight)
    trainer = Trainer(path, objective, TrainerConfig(lr=args.lr, mini_batches=args.mini_batches,
                                                     micro_batch_size=32, lr_decay_steps=args.lr_decay_steps))
    start = time.monotonic()
    for step in range(args.steps):
        # 8 groups of 8 samples; a group shares its env seed (and so its first prompt)
        episodes = [Episode(make_env("frozenlake", max_turns=8, progress_reward=0.5), tok,
                            seed=step * 100 + i // 8) for i in range(64)]
        params = SamplingParams(max_tokens=1, temperature=1.0, seed=args.seed * 100003 + step,
                                logprobs_at_temperature=True)
        m = trainer.step(run_episodes(engine, episodes, params))
        engine.load_weights(trainer.export_weights(), trainer.version)
        print(f"step {step} success {m['success_rate']:.3f} reward {m['reward_mean']:+.3f} "
              f"entropy {m['entropy']:.3f} grad_norm {m['grad_norm']:.3f} lr {m['lr']:.2e} "
              f"{time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
