"""`rose init-model`: write a random-initialised checkpoint, or import a packaged pretrained one."""

from __future__ import annotations

import argparse

from rose.model.device import DTYPES
from rose.model.presets import ARCHS, PRESETS, init_model
from rose.model.pretrained import PRETRAINED, init_pretrained


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(PRETRAINED), required=True,
                   help=f"random: {', '.join(PRESETS)} (with --arch); pretrained, imported from "
                        f"its installed package: {', '.join(PRETRAINED)}")
    p.add_argument("--arch", choices=ARCHS, help="the architecture of a random preset")
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--seed", type=int, default=0, help="a random preset's seed")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="a pretrained preset's dtype once imported (default: float32)")


def run(args: argparse.Namespace) -> int:
    if args.preset in PRETRAINED:
        if args.arch is not None:
            raise ValueError(f"--arch is for the random presets ({', '.join(PRESETS)}); "
                             f"{args.preset} is pretrained and brings its own")
        out = init_pretrained(args.preset, args.out, DTYPES[args.dtype])
        print(f"imported {args.preset} ({args.dtype}) to {out}")
        return 0
    if args.arch is None:
        raise ValueError(f"--arch is required for the random preset {args.preset}; "
                         f"expected one of {', '.join(ARCHS)}")
    out = init_model(args.arch, args.preset, args.out, seed=args.seed)
    print(f"wrote {args.arch}/{args.preset} checkpoint to {out}")
    return 0
