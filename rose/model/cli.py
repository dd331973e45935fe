"""`rose init-model`: write a random-initialised checkpoint with its tokenizer."""

from __future__ import annotations

import argparse

from rose.model.presets import ARCHS, PRESETS, init_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=ARCHS, required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    out = init_model(args.arch, args.preset, args.out, seed=args.seed)
    print(f"wrote {args.arch}/{args.preset} checkpoint to {out}")
    return 0
