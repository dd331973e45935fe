"""Episodes as token streams: prompts as the chat template renders them, replies as sampled."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rose.engine import LLMEngine, SamplingParams
from rose.model import Tokenizer, load_tokenizer
from rose.rl import Episode, Trainer, TrainerConfig, Trajectory, make_env, run_episodes
from rose.rl.envs import FrozenLake

# Qwen3's behaviour, in a template of its own: an assistant reply before the last user message is
# rendered without its reasoning (the text after its </think>); after it, the last reply (or one
# with reasoning) gets a think block, empty if it had none. So a conversation's rendering is not a
# prefix of its continuation's: the next user message strips the reply it follows.
QWEN3_LIKE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- set content, reasoning = m.content, '' %}
{%- if '</think>' in m.content %}
{%- set content = m.content.split('</think>')[-1].lstrip('\n') %}
{%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
# Qwen3 with thinking off (enable_thinking=False): the generation prompt opens and closes an empty
# think block, which the reply's rendering leaves out once the next user message follows: no turn
# extends the last.
QWEN3_LIKE_NO_THINKING = QWEN3_LIKE.replace(r"assistant\n' }}", r"assistant\n<think>\n\n</think>\n\n' }}")


def _with_template(checkpoint: Path, tmp_path: Path, template: str) -> Tokenizer:
    """The checkpoint's tokenizer with `template` as its chat_template.jinja."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(template)
    return load_tokenizer(tmp_path)


def test_episode_tokens_follow_the_chat_template(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(tiny_qwen3)
    env = FrozenLake()
    episode = Episode(env, tok, seed=3)
    assert episode.trajectory.group_id == ("frozenlake", 3)
    messages = [{"role": "system", "content": env.system_prompt},
                {"role": "user", "content": "PFFF\nFHFH\nFFFH\nHFFG\nYou are at row 0, column 0."}]
    assert episode.prompt_ids == tok.encode(tok.apply_chat_template(messages))
    # A reply closed by the end-of-message token, then one cut off without it.
    first = [*tok.encode("Down"), tok.eos_token_id]
    episode.record(first, [-1.0] * len(first), [0] * len(first))
    second = tok.encode("<action>Down</action>")
    result = episode.record(second, [-2.0] * len(second), [1] * len(second))
    messages += [{"role": "assistant", "content": "Down"},
                 {"role": "user", "content": "SFFF\nPHFH\nFFFH\nHFFG\nYou are at row 1, column 0."},
                 {"role": "assistant", "content": "<action>Down</action>"},
                 {"role": "user", "content": result.observation}]
    expected = tok.apply_chat_template(messages)
    assert tok.decode(episode.prompt_ids, skip_special_tokens=False) == expected
    turns = episode.trajectory.turns
    assert [t.text for t in turns] == ["Down", "<action>Down</action>"]
    assert turns[1].prompt_ids == tok.encode("\n<|im_start|>user\nSFFF\nPHFH\nFFFH\nHFFG\n"
                                             "You are at row 1, column 0.<|im_end|>\n<|im_start|>assistant\n")
    [flat] = episode.trajectory.flatten()  # ChatML renders prefixes: one sequence
    assert flat.token_ids.tolist() == episode.prompt_ids[:len(flat.token_ids)]
    assert int(flat.loss_mask.sum()) == len(first) + len(second)


def test_episode_ends_with_the_env_and_at_the_context_limit(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(tiny_qwen3)
    episode = Episode(make_env("frozenlake"), tok, seed=0, group_id="g")
    for action in ("Down", "Down", "Right", "Down", "Right", "Right"):
        ids = tok.encode(action)
        episode.record(ids, [0.0] * len(ids), [0] * len(ids))
    t = episode.trajectory
    assert episode.done and t.done and t.success and not t.truncated and t.reward == 1.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        episode.record([1], [0.0], [0])
    short = Episode(make_env("frozenlake"), tok, seed=0, max_context_tokens=len(episode.prompt_ids[:90]) + 40)
    ids = tok.encode("Up")
    short.record(ids, [0.0], [0])
    assert short.done and short.trajectory.truncated and not short.trajectory.done


def test_run_episodes_on_the_engine(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(tiny_qwen3)
    engine = LLMEngine.from_pretrained(tiny_qwen3, kv_cache_bytes=4 * 1024**2)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, stop_token_ids=tok.stop_token_ids)

    def play() -> list[Trajectory]:
        episodes = [Episode(make_env("frozenlake", max_turns=3), tok, seed=0) for _ in range(4)]
        return run_episodes(engine, episodes, params)

    trajectories = play()
    assert all(t.done and len(t.turns) == 3 for t in trajectories)  # random replies: invalid, 3 turns
    outputs = [tuple(t.turns[0].output_ids) for t in trajectories]
    assert len(set(outputs)) > 1  # the group's samples differ
    assert outputs == [tuple(t.turns[0].output_ids) for t in play()]  # and the seed repeats them
    turn = trajectories[0].turns[0]
    assert turn.versions == [0] * len(turn.output_ids) and all(lp < 0 for lp in turn.logprobs)
    # The engine's logprobs are the model's own: recompute them from the flattened sequence.
    [flat] = trajectories[0].flatten()
    with torch.no_grad():
        logp = engine.model(flat.token_ids[None, :-1]).float().log_softmax(-1)[0]
    recomputed = logp.gather(-1, flat.token_ids[1:, None])[:, 0][flat.loss_mask[1:]]
    assert recomputed.tolist() == pytest.approx(flat.old_logprobs[flat.loss_mask].tolist(), abs=1e-4)


def test_a_template_that_drops_earlier_reasoning_starts_new_sequences(tiny_qwen3: Path,
                                                                       tmp_path: Path) -> None:
    """Each prompt is the template's rendering of the conversation so far; a reply that thought
    is rendered without its reasoning once the next user message follows, so the next prompt
    does not extend the context and starts a sequence of its own. The trained tokens are exactly
    the sampled ones, each in the context it was sampled in."""
    tok = _with_template(tiny_qwen3, tmp_path, QWEN3_LIKE)
    episode = Episode(FrozenLake(), tok, seed=3)
    replies = [[*tok.encode("<think>The hole is at row 1.</think><action>Down</action>"), tok.eos_token_id],
               [*tok.encode("Down"), tok.eos_token_id],
               tok.encode("<think>Right is safe</think>Right")]  # cut off before its end of message
    prompts = []
    for k, reply in enumerate(replies):
        prompts.append(episode.prompt_ids)
        rendered = tok.apply_chat_template(episode.messages)
        assert tok.decode(episode.prompt_ids, skip_special_tokens=False) == rendered
        episode.record(reply, [-0.5 - k] * len(reply), [k] * len(reply))
    turns = episode.trajectory.turns
    assert [t.new_sequence for t in turns] == [False, True, False]
    # Turn 1's rendering dropped turn 0's reasoning: its prompt is all of it, re-encoded.
    assert "The hole" not in tok.decode(prompts[1], skip_special_tokens=False)
    assert turns[1].prompt_ids == prompts[1] == tok.encode(tok.apply_chat_template(episode.messages[:4]))
    # Turn 2's extends turn 1's context: the reply's sampled tokens stay, the observation is added.
    assert prompts[2][:len(prompts[1]) + len(replies[1])] == prompts[1] + replies[1]
    sequences = episode.trajectory.flatten()
    assert len(sequences) == 2
    for seq, run in zip(sequences, [[0], [1, 2]], strict=True):
        # Trained: the sampled tokens and nothing else, with their logprobs and versions.
        assert seq.token_ids[seq.loss_mask].tolist() == [i for k in run for i in replies[k]]
        assert seq.old_logprobs[seq.loss_mask].tolist() == [-0.5 - k for k in run for _ in replies[k]]
        assert seq.versions[seq.loss_mask].tolist() == [k for k in run for _ in replies[k]]
        for k in run:  # each reply follows exactly the prompt it was sampled from
            n = len(prompts[k])
            assert seq.token_ids[:n + len(replies[k])].tolist() == prompts[k] + replies[k]


def test_episodes_on_a_template_that_never_renders_a_prefix_sample_and_train(tiny_qwen3: Path,
                                                                              tmp_path: Path) -> None:
    """With Qwen3's thinking off every turn is a sequence of its own: the engine's logprobs are the
    model's own on each flattened sequence (each token trains in the context it was sampled in),
    and the trainer takes the batch."""
    tok = _with_template(tiny_qwen3, tmp_path, QWEN3_LIKE_NO_THINKING)
    engine = LLMEngine.from_pretrained(tiny_qwen3, kv_cache_bytes=4 * 1024**2)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, stop_token_ids=tok.stop_token_ids)
    episodes = [Episode(make_env("frozenlake", max_turns=3), tok, seed=0, group_id="g") for _ in range(4)]
    trajectories = run_episodes(engine, episodes, params)
    assert all(len(t.turns) == 3 and [u.new_sequence for u in t.turns] == [False, True, True]
               for t in trajectories)
    for t in trajectories:
        sequences = t.flatten()
        assert len(sequences) == 3
        for seq, turn in zip(sequences, t.turns, strict=True):
            assert seq.token_ids.tolist() == turn.prompt_ids + turn.output_ids
            with torch.no_grad():
                logp = engine.model(seq.token_ids[None, :-1]).float().log_softmax(-1)[0]
            recomputed = logp.gather(-1, seq.token_ids[1:, None])[:, 0][seq.loss_mask[1:]]
            assert recomputed.tolist() == pytest.approx(turn.logprobs, abs=1e-4)
    m = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-3)).step(trajectories)
    assert m["sequences"] == 12 and m["tokens"] == sum(t.num_generated_tokens for t in trajectories)
    assert m["updates"] == 1
