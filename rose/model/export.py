"""`rose export`: a checkpoint `rose train` wrote, as others load it.

A LoRA run's checkpoint is a PEFT adapter plus the trainer's state: `rose export CKPT --out DIR`
writes the adapter alone with the tokenizer's files (what `peft` and vLLM's `--lora-modules`
load), `--merge` the base model with the adapter folded into its weights, as an HF checkpoint
(what `vllm serve`, `rose serve` and transformers load with no adapter support). A full-weight
checkpoint exports as the model and its tokenizer, without the optimizer's state.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from rose.model.checkpoint import INDEX_FILE, load_model, save_model
from rose.model.config import CheckpointError
from rose.model.lora import CONFIG_FILE, WEIGHTS_FILE, adapter_base, is_adapter, load_adapter, merged

# What a checkpoint directory holds beside the model that is not the tokenizer's.
_NOT_TOKENIZER = ("config.json", INDEX_FILE, CONFIG_FILE, WEIGHTS_FILE, "trainer_state.pt",
                  "checkpoint_complete.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint `rose train` wrote (runs/.../step-N)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA checkpoint: write its base with the adapter folded in (an HF checkpoint)")


def _tokenizer_files(source: Path, out: Path) -> None:
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name not in _NOT_TOKENIZER:
            shutil.copyfile(file, out / file.name)


def export(checkpoint: str | Path, out: str | Path, merge: bool = False) -> Path:
    """Write `checkpoint` to `out` as described above; the output directory."""
    source, out = Path(checkpoint), Path(out)
    if not source.is_dir():
        raise CheckpointError(f"{source}: no such checkpoint directory")
    if source.resolve() == out.resolve():
        raise ValueError(f"--out {out} is the checkpoint itself; give another directory")
    adapter = is_adapter(source)
    if merge and not adapter:
        raise ValueError(f"--merge: {source} holds the whole model (no {CONFIG_FILE}); there is no "
                         "adapter to merge")
    out.mkdir(parents=True, exist_ok=True)
    if adapter and not merge:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            shutil.copyfile(source / name, out / name)
    elif adapter:
        config, tensors, _ = load_adapter(source)
        base = load_model(adapter_base(source), "float32", "cpu")
        save_model(merged(base, config, tensors), out)
    else:
        save_model(load_model(source, "float32", "cpu"), out)
    _tokenizer_files(source, out)
    return out


def run(args: argparse.Namespace) -> int:
    out = export(args.checkpoint, args.out, args.merge)
    what = "merged model" if args.merge else "adapter" if is_adapter(args.checkpoint) else "model"
    print(f"wrote the {what} of {args.checkpoint} to {out}")
    return 0
