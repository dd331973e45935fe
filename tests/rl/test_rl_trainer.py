"""The trainer: one step's figures, accumulation and data-parallel invariance, bf16 export, state."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rl_batches import random_batch
from torch.distributed.tensor import DTensor

from rose.engine import LLMEngine, SamplingParams
from rose.model import init_model, load_model
from rose.rl import Objective, Trainer, TrainerConfig, Trajectory, TurnRecord, shard_by_group
from rose.rl.trainer import process_group_backend
from rose.runtime.config import resume_checkpoint


def _on_policy(batch: list[Trajectory], model: torch.nn.Module, temperature: float = 1.0) -> list[Trajectory]:
    """Replace the behaviour logprobs with the model's own (at `temperature`)."""
    for t in batch:
        [flat] = t.flatten()
        with torch.no_grad():
            logp = (model(flat.token_ids[None, :-1]).float() / temperature).log_softmax(-1)[0]
        own = [0.0, *logp.gather(-1, flat.token_ids[1:, None])[:, 0].tolist()]
        pos = 0
        for turn in t.turns:
            pos += len(turn.prompt_ids)
            turn.logprobs = own[pos:pos + len(turn.output_ids)]
            pos += len(turn.output_ids)
    return batch


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _flatten_rewards(batch: list[Trajectory], group: object) -> None:
    """Give every trajectory of `group` the return 1."""
    for t in batch:
        if t.group_id == group:
            for i, turn in enumerate(t.turns):
                turn.reward = float(i == 0)


def _record_gradients(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """The gradients each optimizer update applies (AdamW is a fixed function of them; its
    first steps, near lr * sign(g), would hide a wrongly scaled gradient)."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    updates: list[dict[str, torch.Tensor]] = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: updates.append(
        {names[id(p)]: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
         for group in opt.param_groups for p in group["params"]}))
    return updates


def _assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name, g in x.items():  # fp32 summation order differs: tolerance relative to the tensor
            torch.testing.assert_close(g, y[name], rtol=1e-5, atol=1e-5 * float(g.abs().max()))


def test_on_policy_step_figures(tiny_qwen3: Path) -> None:
    trainer = Trainer(tiny_qwen3, Objective.grpo(kl_coef=0.1), TrainerConfig(lr=1e-3))
    batch = _on_policy(random_batch(), trainer.model)
    before = _params(trainer)
    m = trainer.step(batch)
    # On policy the ratio is 1: nothing clipped, and the policy is its own reference.
    assert m["clip_fraction"] == 0 and m["kl"] == pytest.approx(0, abs=1e-6)
    # Sequence aggregation with ratio 1: loss = -mean(A) = 0, as GRPO advantages sum to 0 per group.
    assert m["loss"] == pytest.approx(0, abs=1e-6)
    assert 5.5 < m["entropy"] < 6.25  # a near-uniform random policy over 512 tokens
    assert m["grad_norm"] > 0 and m["updates"] == 1 and m["version"] == trainer.version == 1
    assert m["sequences"] == 12 and m["tokens"] == sum(t.num_generated_tokens for t in batch)
    assert m["reward_mean"] == pytest.approx(sum(t.reward for t in batch) / 12)
    assert any(not torch.equal(before[n], p) for n, p in _params(trainer).items())


@pytest.mark.parametrize("step_weight", [0.0, 1.0])
def test_token_aggregation_loss_by_hand(tiny_qwen3: Path, step_weight: float) -> None:
    """With step-level advantages each turn's tokens carry their own turn's advantage."""
    trainer = Trainer(tiny_qwen3, Objective(aggregation="token-mean", step_advantage_weight=step_weight),
                      TrainerConfig(lr=1e-3))
    batch = random_batch()
    for t in batch:  # turn k of every trajectory starts from the same state: shared anchors
        for k, turn in enumerate(t.turns):
            turn.prompt_ids = [k + 1, 7]
    batch = _on_policy(batch, trainer.model)
    prepared = trainer.objective.prepare(batch)
    pairs = [(len(turn.output_ids), a)
             for t, advs in zip(prepared.trajectories, prepared.advantages, strict=True)
             for turn, a in zip(t.turns, advs, strict=True)]
    assert (len({a for _, a in pairs}) > len(prepared.trajectories)) == (step_weight > 0)
    # Ratio 1: loss = -sum over turns of |o| A / sum |o|.
    expected = -sum(n * a for n, a in pairs) / sum(n for n, _ in pairs)
    assert trainer.step(batch)["loss"] == pytest.approx(expected, abs=1e-6)


def _token_mean_loss(trainer: Trainer, batch: list[Trajectory]) -> float:
    """-sum |o| A / sum |o| over the turns: the token-mean loss at ratio 1."""
    prepared = trainer.objective.prepare(batch)
    pairs = [(len(turn.output_ids), a)
             for t, advs in zip(prepared.trajectories, prepared.advantages, strict=True)
             for turn, a in zip(t.turns, advs, strict=True)]
    return -sum(n * a for n, a in pairs) / sum(n for n, _ in pairs)


def test_recomputed_old_logprobs_weight_each_token_by_its_truncated_is_ratio(tiny_qwen3: Path) -> None:
    """The engine sampled with probabilities a third of the trainer's (a stale or mismatched
    behaviour policy): recomputed old logprobs give ratio 1, and each token weighs min(3, cap 2)."""
    objective = Objective(aggregation="token-mean", recompute_old_logprobs=True, tis_cap=2.0)
    trainer = Trainer(tiny_qwen3, objective, TrainerConfig(lr=1e-3))
    batch = _on_policy(random_batch(), trainer.model)
    for t in batch:
        for turn in t.turns:
            turn.logprobs = [lp - math.log(3.0) for lp in turn.logprobs]
    expected = 2.0 * _token_mean_loss(trainer, batch)
    m = trainer.step(batch)
    assert m["is_weight"] == pytest.approx(2.0, rel=1e-5) and m["clip_fraction"] == 0
    assert m["loss"] == pytest.approx(expected, abs=1e-5)
    # Without recomputing, the engine's logprobs are the old ones: ratio 3, the positive-advantage
    # tokens clipped.
    plain = Trainer(tiny_qwen3, Objective(aggregation="token-mean"), TrainerConfig(lr=1e-3)).step(batch)
    assert plain["clip_fraction"] > 0 and plain["is_weight"] == 1.0


def test_logprobs_are_taken_at_the_rollout_temperature(tiny_qwen3: Path) -> None:
    """Behaviour logprobs recorded at T = 0.5 are the trainer's own at T = 0.5: ratio 1. A
    trainer at T = 1 would see ratios far from 1 and clip."""
    batch = _on_policy(random_batch(), load_model(tiny_qwen3), temperature=0.5)
    at_half = Trainer(tiny_qwen3, Objective.grpo(), TrainerConfig(lr=1e-3, temperature=0.5)).step(batch)
    assert at_half["clip_fraction"] == 0 and at_half["loss"] == pytest.approx(0, abs=1e-6)
    at_one = Trainer(tiny_qwen3, Objective.grpo(), TrainerConfig(lr=1e-3)).step(batch)
    assert at_one["clip_fraction"] > 0


def test_tokens_older_than_the_version_lag_do_not_train(tiny_qwen3: Path) -> None:
    trainer = Trainer(tiny_qwen3, Objective(max_version_lag=2), TrainerConfig(lr=1e-3))
    trainer.version = 5
    batch = random_batch()
    for i, t in enumerate(batch):  # every other trajectory sampled 4 versions ago: stale
        for turn in t.turns:
            turn.versions = [1 if i % 2 else 4] * len(turn.output_ids)
    stale = sum(t.num_generated_tokens for i, t in enumerate(batch) if i % 2)
    m = trainer.step(batch)
    assert m["stale_tokens"] == stale > 0
    assert m["tokens"] == sum(t.num_generated_tokens for t in batch) - stale
    assert m["version_lag"] == pytest.approx(1.0)  # only the fresh tokens, sampled at version 4


@pytest.mark.parametrize("objective", [Objective.grpo(), Objective.dapo()])
def test_micro_batches_and_checkpointing_do_not_change_the_step(tiny_qwen3: Path,
                                                                objective: Objective) -> None:
    batch = random_batch()
    one = Trainer(tiny_qwen3, objective, TrainerConfig(lr=1e-2, micro_batch_size=64))
    many = Trainer(tiny_qwen3, objective,
                   TrainerConfig(lr=1e-2, micro_batch_size=1, gradient_checkpointing=True))
    g1, g2 = _record_gradients(one), _record_gradients(many)
    m1, m2 = one.step(batch), many.step(batch)
    for key in ("loss", "grad_norm", "clip_fraction", "entropy"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    assert m1["clip_fraction"] > 0
    _assert_same(g1, g2)


def test_mini_batches_take_several_updates(tiny_qwen3: Path) -> None:
    trainer = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-3, mini_batches=3))
    m = trainer.step(random_batch())
    assert m["updates"] == 3 and trainer.version == 1


def test_a_batch_with_nothing_to_learn_skips_the_update(tiny_qwen3: Path) -> None:
    trainer = Trainer(tiny_qwen3, Objective.dapo())
    flat = random_batch(groups=2)
    _flatten_rewards(flat, ("g", 0))
    _flatten_rewards(flat, ("g", 1))
    before = _params(trainer)
    m = trainer.step(flat)
    assert m["updates"] == 0 and m["groups_kept"] == 0 and m["groups"] == 2 and trainer.version == 1
    assert all(torch.equal(before[n], p) for n, p in _params(trainer).items())


def test_a_trajectory_cut_before_its_first_turn_only_counts_in_its_group(tiny_qwen3: Path) -> None:
    trainer = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-3))
    m = trainer.step([*random_batch(groups=1), Trajectory(("g", 0), truncated=True)])
    assert m["sequences"] == 4 and m["updates"] == 1 and m["reward_mean"] == pytest.approx(
        sum(t.reward for t in random_batch(groups=1)) / 5)


def test_export_weights_feed_the_engine(tiny_qwen3: Path) -> None:
    trainer = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-2))
    trainer.step(random_batch())
    exported = dict(trainer.export_weights())
    params = dict(trainer.model.named_parameters())
    assert set(exported) == set(params) and "lm_head.weight" not in exported  # tied: once
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, params[name].detach().to(torch.bfloat16))
        assert tensor.data_ptr() != params[name].data_ptr()
    engine = LLMEngine.from_pretrained(tiny_qwen3, kv_cache_bytes=4 * 1024**2)
    engine.load_weights(trainer.export_weights(), trainer.version)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert out.versions == [1, 1]
    head = dict(engine.model.named_parameters(remove_duplicate=False))["lm_head.weight"]
    assert torch.equal(head, exported["model.embed_tokens.weight"].float())


def test_the_device_dtype_and_chunks_named_are_honoured(tiny_qwen3: Path) -> None:
    """device="cpu" and dtype="float32" named take the defaults' step here; log-probabilities in
    chunks of 7 tokens the same step; bf16 compute (autocast) keeps fp32 master weights."""
    batch = random_batch()
    default = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-3)).step(batch)
    named = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-3, device="cpu", dtype="float32"))
    assert named.step(batch) == default
    chunked = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-3, logprob_chunk_tokens=7)).step(batch)
    assert chunked == pytest.approx(default, rel=1e-5, abs=1e-6)
    bf16 = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-3, device="cpu", dtype="bfloat16"))
    m = bf16.step(batch)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    assert m["entropy"] == pytest.approx(default["entropy"], rel=1e-2)
    assert m["loss"] == pytest.approx(default["loss"], rel=0.1, abs=1e-2)


def test_ranks_on_cuda_use_nccl_and_on_the_cpu_gloo() -> None:
    assert process_group_backend(torch.device("cuda", 1)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_save_and_resume(tiny_qwen3: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-2))
    trainer.step(random_batch())
    trainer.save(tmp_path / "ckpt")
    resumed = Trainer(tmp_path / "ckpt", config=TrainerConfig(lr=1e-2))
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.version == 1
    batch = random_batch(seed=1)
    trainer.step(batch)
    resumed.step(batch)
    for name, p in _params(trainer).items():
        torch.testing.assert_close(p, _params(resumed)[name])
    with pytest.raises(ValueError, match=r"no trainer_state\.pt"):
        resumed.load_state(tmp_path)


def test_the_schedule_follows_the_steps_taken_not_the_weights_version(tiny_qwen3: Path,
                                                                       tmp_path: Path) -> None:
    """A restart's renumbering moves the version, not the learning-rate schedule; both resume."""
    trainer = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-2, warmup_steps=4))
    assert trainer.step(random_batch())["steps"] == 1
    trainer.version = 7  # rolled-back weights named anew
    assert trainer.lr == pytest.approx(1e-2 * 2 / 4)  # the second warmup step
    m = trainer.step(random_batch(seed=1))
    assert (m["version"], m["steps"]) == (8, 2)
    trainer.save(tmp_path / "ckpt")
    resumed = Trainer(tmp_path / "ckpt", config=TrainerConfig(lr=1e-2, warmup_steps=4))
    resumed.load_state(tmp_path / "ckpt")
    assert (resumed.version, resumed.steps) == (8, 2)


def test_a_llama_policy_trains_and_saves_as_llama(tmp_path: Path) -> None:
    policy = init_model("llama", "tiny", tmp_path / "initial", seed=3)
    trainer = Trainer(policy, config=TrainerConfig(lr=1e-2))
    before = _params(trainer)
    assert trainer.step(random_batch())["updates"] == 1
    trainer.save(tmp_path / "ckpt")
    saved = load_model(tmp_path / "ckpt")
    assert saved.config.model_type == "llama"
    after = _params(trainer)
    assert all(torch.equal(p, after[n]) for n, p in saved.named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in after.items())


def test_the_kl_reference_is_saved_and_restored_never_replaced(tiny_qwen3: Path, tmp_path: Path) -> None:
    objective = Objective.grpo(kl_coef=0.1)
    trainer = Trainer(tiny_qwen3, objective, TrainerConfig(lr=1e-2))
    reference = _params(trainer)
    trainer.step(random_batch())
    trainer.save(tmp_path / "ckpt")
    resumed = Trainer(tmp_path / "ckpt", objective, TrainerConfig(lr=1e-2))
    resumed.load_state(tmp_path / "ckpt")
    # The reference is the run's starting policy, not the resumed one.
    for name, p in resumed.ref_model.named_parameters():
        torch.testing.assert_close(p, reference[name], rtol=0, atol=0)
    assert any(not torch.equal(p, reference[n]) for n, p in _params(resumed).items())
    batch = random_batch(seed=1)
    assert trainer.step(batch)["kl"] == pytest.approx(resumed.step(batch)["kl"], rel=1e-5)
    # Without a KL penalty there is no reference, and none is saved; such a checkpoint cannot
    # resume a KL run silently.
    plain = Trainer(tiny_qwen3)
    assert plain.ref_model is None
    assert not (plain.save(tmp_path / "plain") / "reference").exists()
    with pytest.raises(ValueError, match=r"no reference/ .*resume with kl_coef 0"):
        Trainer(tmp_path / "plain", objective).load_state(tmp_path / "plain")


def _crash_midway(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next weight file written gets half its bytes, then the process "dies"."""
    import rose.model.checkpoint

    def torn(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str]) -> None:
        Path(filename).write_bytes(b"\0" * 1000)
        raise OSError("disk gone midway")

    monkeypatch.setattr(rose.model.checkpoint, "save_file", torn)


def test_a_save_that_crashes_midway_keeps_the_previous_checkpoint(
        tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-2))
    trainer.step(random_batch())
    trainer.save(tmp_path / "step-1")
    saved = _params(trainer)
    trainer.step(random_batch(seed=1))
    with monkeypatch.context() as m:
        _crash_midway(m)
        for step in ("step-1", "step-2"):  # over the previous checkpoint, and a new one
            with pytest.raises(OSError, match="disk gone midway"):
                trainer.save(tmp_path / step)
    assert resume_checkpoint(tmp_path) == tmp_path / "step-1"
    resumed = Trainer(tmp_path / "step-1")
    resumed.load_state(tmp_path / "step-1")
    assert resumed.version == 1
    for name, p in _params(resumed).items():
        torch.testing.assert_close(p, saved[name], rtol=0, atol=0)
    trainer.save(tmp_path / "step-2")  # and nothing of the crashed saves is left behind
    assert resume_checkpoint(tmp_path) == tmp_path / "step-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]


def test_resume_passes_over_torn_checkpoints(tiny_qwen3: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_qwen3)
    trainer.save(tmp_path / "step-2", assets=[tiny_qwen3 / "tokenizer.json"])
    assert (tmp_path / "step-2" / "tokenizer.json").is_file()
    # What a crash left under the old save: config.json written, the weights not yet.
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / "config.json").write_text((tiny_qwen3 / "config.json").read_text())
    (tmp_path / "step-x").mkdir()
    assert resume_checkpoint(tmp_path) == tmp_path / "step-2"
    assert resume_checkpoint(tmp_path / "step-2") == tmp_path / "step-2"
    with pytest.raises(ValueError, match=r"step-10: not a complete checkpoint"):
        resume_checkpoint(tmp_path / "step-10")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(lr=0), "lr must be > 0"),
    (dict(lr="1e-3"), "lr must be a finite number"),
    (dict(weight_decay=-1), "weight_decay"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(max_grad_norm=0), "max_grad_norm"),
    (dict(micro_batch_size=0), "micro_batch_size must be an integer >= 1"),
    (dict(lr_decay_steps=-1), "lr_decay_steps must be an integer >= 0"),
    (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0"),
    (dict(min_lr_ratio=2.0), r"min_lr_ratio must be in \[0, 1\]"),
    (dict(mini_batches=1.5), "mini_batches"),
])
def test_bad_trainer_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**kwargs)


def test_bad_model_and_batch(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match="master weights must be float32"):
        Trainer(load_model(tiny_qwen3, dtype=torch.bfloat16))
    trainer = Trainer(tiny_qwen3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        trainer.step([Trajectory("g", [TurnRecord([1], [9999], [0.0], [0])]),
                      Trajectory("g", [TurnRecord([1], [2], [0.0], [0])])])
    long = Trajectory("long", [TurnRecord([1] * 3000, [2], [0.0], [0])])
    with pytest.raises(ValueError, match="3001 tokens; the model's context is 2048"):
        trainer.step([long])


# -- data parallelism -----------------------------------------------------------------------------

CONFIG = TrainerConfig(lr=1e-2, micro_batch_size=3)
# One objective per aggregation; Dr. GRPO's constant small enough that its loss is not tiny.
PARALLEL_OBJECTIVES = {
    "token-mean": Objective.dapo(overlong_max_tokens=10, overlong_cache_tokens=4),
    "seq-mean-token-mean": Objective.grpo(),
    "seq-mean-token-sum-norm": Objective.dr_grpo(norm_tokens=8),
}


def _rank(rank: int, world: int, port: int, path: Path, objective: Objective,
          batches: list[list[list[Trajectory]]], out: Path, sharding: str = "ddp") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trainer = Trainer(path, objective, dataclasses.replace(CONFIG, sharding=sharding))
        gradients = _record_gradients(trainer)
        metrics = [trainer.step(shards[rank]) for shards in batches]
        weights = dict(trainer.export_weights(torch.float32))  # every rank: the shards are gathered
        trainer.save(out.with_suffix(".ckpt"))
        if rank == 0:
            torch.save({"gradients": gradients, "metrics": metrics, "weights": weights}, out)
    finally:
        dist.destroy_process_group()
    # Done: skip the interpreter's teardown. In about 1 run in 20 a rank aborted there, after
    # both had destroyed their group ("terminate called without an active exception", no Python
    # frame: a thread inside torch's gloo torn down at exit), failing a test whose work was done.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loss_by_hand(model: torch.nn.Module, batch: list[Trajectory], objective: Objective) -> float:
    """The step's loss token by token in floats: each generated token's ratio to its behaviour
    logprob, the clip and the dual clip, then the objective's aggregation."""
    prepared = objective.prepare(batch)
    sequences = []  # each trajectory's token losses
    for t, advantages in zip(prepared.trajectories, prepared.advantages, strict=True):
        ids = [i for turn in t.turns for i in turn.prompt_ids + turn.output_ids]
        with torch.no_grad():
            logp = model(torch.tensor([ids[:-1]])).float().log_softmax(-1)[0]
        losses, pos = [], 0
        for turn, a in zip(t.turns, advantages, strict=True):
            pos += len(turn.prompt_ids)
            for token, old in zip(turn.output_ids, turn.logprobs, strict=True):
                ratio = math.exp(float(logp[pos - 1, token]) - old)
                clipped = min(max(ratio, 1 - objective.clip_low), 1 + objective.clip_high)
                loss = -min(ratio * a, clipped * a)
                losses.append(min(loss, -objective.clip_ratio_c * a) if a < 0 else loss)
                pos += 1
        sequences.append(losses)
    if objective.aggregation == "token-mean":
        return sum(map(sum, sequences)) / sum(map(len, sequences))
    mean = objective.aggregation == "seq-mean-token-mean"
    return sum(sum(s) / (len(s) if mean else objective.norm_tokens) for s in sequences) / len(sequences)


@pytest.mark.parametrize("aggregation, sharding", [*((a, "ddp") for a in PARALLEL_OBJECTIVES),
                                                    ("token-mean", "fsdp")])
def test_two_ranks_with_half_the_batch_each_match_one_rank(tiny_qwen3: Path, tmp_path: Path,
                                                           aggregation: str, sharding: str) -> None:
    """Off policy (behaviour logprobs away from the model's: ratios != 1, some clipped): two
    ranks take one rank's step, whose loss is the one computed by hand; replicated (DDP) or
    sharded (FSDP2, whose ranks run different numbers of micro-batches here), with the same
    weights exported and saved."""
    objective = PARALLEL_OBJECTIVES[aggregation]
    assert objective.aggregation == aggregation
    # Five groups (uneven over two ranks), one of them uninformative (dropped by DAPO).
    steps = [random_batch(groups=5, seed=s) for s in (0, 1)]
    _flatten_rewards(steps[0], ("g", 4))  # and its lengths stay under the overlong penalty's 6
    assert any(t.num_generated_tokens > 6 for t in steps[0])  # others are penalised
    single = Trainer(tiny_qwen3, objective, CONFIG)
    by_hand = _loss_by_hand(single.model, steps[0], objective)
    gradients = _record_gradients(single)
    expected = [single.step(batch) for batch in steps]
    assert expected[0]["loss"] == pytest.approx(by_hand, rel=1e-5)
    assert expected[0]["clip_fraction"] > 0
    port = _free_port()
    out = tmp_path / "rank0.pt"
    shards = [shard_by_group(b, 2) for b in steps]
    mp.spawn(_rank, args=(2, port, tiny_qwen3, objective, shards, out, sharding), nprocs=2)
    got = torch.load(out, weights_only=False)
    # The first step's gradients match to fp32 summation order; the second step starts from
    # weights that Adam's near-sign first update moved by that noise, so it matches less tightly.
    _assert_same(got["gradients"][:1], gradients[:1])
    for want, have, rel in zip(expected, got["metrics"], (1e-5, 1e-3), strict=True):
        for key in ("loss", "grad_norm", "clip_fraction", "entropy", "tokens", "sequences", "groups_kept",
                    "reward_mean"):
            assert have[key] == pytest.approx(want[key], rel=rel, abs=1e-7), key
    assert expected[0]["groups_kept"] == (4 if objective.dynamic_sampling else 5)
    # Two Adam updates at lr 1e-2 from gradients equal to fp32 summation order: a gathered shard
    # out of place would be off by the weights' own scale, not a tenth of one update.
    single_weights = dict(single.export_weights(torch.float32))
    for name, w in got["weights"].items():
        torch.testing.assert_close(w, single_weights[name], rtol=0, atol=1e-3)
    saved = load_model(out.with_suffix(".ckpt"), torch.float32)
    for name, w in saved.named_parameters():
        torch.testing.assert_close(w, got["weights"][name])


def test_an_fsdp_checkpoint_resumes_only_sharded(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Its optimizer state is saved whole by parameter name: a one-rank run cannot take it."""
    port = _free_port()
    out = tmp_path / "rank0.pt"
    batches = [shard_by_group(random_batch(), 2)]
    mp.spawn(_rank, args=(2, port, tiny_qwen3, Objective.grpo(), batches, out, "fsdp"),
             nprocs=2)
    trainer = Trainer(out.with_suffix(".ckpt"), config=CONFIG)
    with pytest.raises(ValueError, match=r"saved with sharding fsdp; resume with train.sharding=fsdp"):
        trainer.load_state(out.with_suffix(".ckpt"))


def test_cosine_lr_decay_follows_the_steps(tiny_qwen3: Path, tmp_path: Path) -> None:
    config = TrainerConfig(lr=1e-3, lr_decay_steps=4, min_lr_ratio=0.1)
    trainer = Trainer(tiny_qwen3, Objective.grpo(), config)
    lrs = [trainer.step(random_batch(seed=s))["lr"] for s in range(3)]
    assert lrs == pytest.approx([1e-3, 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))), 0.55e-3])
    trainer.save(tmp_path / "ckpt")
    resumed = Trainer(tmp_path / "ckpt", Objective.grpo(), config)
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.lr == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4))))
    trainer.steps = 9  # past the horizon: the floor
    assert trainer.lr == pytest.approx(1e-4)
    assert Trainer(tiny_qwen3, Objective.grpo(), TrainerConfig(lr=1e-3)).lr == 1e-3


def test_warmup_rises_linearly_to_the_learning_rate(tiny_qwen3: Path) -> None:
    trainer = Trainer(tiny_qwen3, Objective.grpo(), TrainerConfig(lr=1e-3, warmup_steps=4))
    lrs = []
    for steps in range(6):
        trainer.steps = steps
        lrs.append(trainer.lr)
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
