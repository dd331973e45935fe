"""`rose generate`: text from a checkpoint through the engine."""

from __future__ import annotations

import argparse

from rose.contracts import SamplingParams
from rose.engine.llm_engine import LLMEngine
from rose.model import load_tokenizer
from rose.model.device import add_device_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF-format checkpoint directory")
    p.add_argument("--prompt", required=True, action="append",
                   help="prompt text; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--logprobs", action="store_true", help="print each token with its logprob")
    add_device_arguments(p)


def run(args: argparse.Namespace) -> int:
    engine = LLMEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop_token_ids=tuple(tok.stop_token_ids))
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
             for p in args.prompt]
    for text, out in zip(texts, engine.generate([tok.encode(t) for t in texts], params), strict=True):
        print(text + tok.decode(out.token_ids))
        if args.logprobs:
            for token, logprob in zip(out.token_ids, out.logprobs, strict=True):
                print(f"  {tok.decode([token], skip_special_tokens=False)!r}\t{logprob:.4f}")
    return 0
