"""The whole loop learns: engine rollouts with their own logprobs, trainer steps, weights back."""

from __future__ import annotations

from pathlib import Path

from rose.engine import LLMEngine, SamplingParams
from rose.rl import Objective, Trainer, TrainerConfig, Trajectory, Turn


def test_a_tiny_policy_learns_a_bandit(tiny_qwen3: Path) -> None:
    """Single-turn bandit: answering with a token from the first quarter of the vocabulary pays
    1, anything else 0. A random policy earns about 0.25; ten GRPO steps lift it well above."""
    engine = LLMEngine.from_pretrained(tiny_qwen3, kv_cache_bytes=4 * 1024**2)
    trainer = Trainer(tiny_qwen3, Objective.grpo(),
                      TrainerConfig(lr=1e-2, mini_batches=2, micro_batch_size=64))
    quarter = trainer.model.config.vocab_size // 4
    prompts = [[1, 300 + k, 2] for k in range(8)]
    rewards = []
    for step in range(10):
        params = [SamplingParams(max_tokens=1, temperature=1.0, seed=step * 100 + i) for i in range(64)]
        outputs = engine.generate([p for p in prompts for _ in range(8)], params)
        batch = [Trajectory(i // 8, [Turn(prompts[i // 8], o.token_ids, o.logprobs, o.versions,
                                          reward=float(o.token_ids[0] < quarter))], done=True)
                 for i, o in enumerate(outputs)]
        assert all(o.versions == [trainer.version] for o in outputs)
        metrics = trainer.step(batch)
        engine.load_weights(trainer.export_weights(), trainer.version)
        rewards.append(metrics["reward_mean"])
    assert rewards[0] < 0.4, rewards
    assert sum(rewards[-2:]) / 2 > 0.6, rewards
