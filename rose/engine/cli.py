"""`rose generate`: greedy or sampled text from a checkpoint."""

from __future__ import annotations

import argparse

import torch

from rose.model import load_model, load_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF-format checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    model, tok = load_model(args.model), load_tokenizer(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    ids = tok.encode(text)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(args.max_tokens):
            nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(nxt)
            if nxt in tok.stop_token_ids:
                break
    print(text + tok.decode(out))
    return 0
