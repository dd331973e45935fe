"""The `rose` command.

Each subcommand lives in the package it drives, as a module with `add_arguments(parser)` and
`run(args) -> int`; only the invoked one is imported, so `rose --help` stays fast.
Benchmarks are `rose bench NAME`, each a module with the same two functions.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

from rose import logs

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "init-model": ("rose.model.cli", "write a random checkpoint, or import a packaged pretrained one"),
    "import-gguf": ("rose.model.gguf_import", "convert a GGUF file (Llama, Qwen2, Qwen3) to HF format"),
    "export": ("rose.model.export", "a training checkpoint as an HF model or a PEFT adapter (--merge)"),
    "generate": ("rose.engine.cli", "generate text from a checkpoint"),
    "simulate": ("rose.sim.cli", "simulate ROSE and its baselines at cluster scale from real traces"),
    "serve": ("rose.coserve.cli", "serve a model over an OpenAI-compatible API, with rollouts beside it"),
    "loadgen": ("rose.coserve.loadgen", "replay a real serving trace against an OpenAI-compatible server"),
    "train": ("rose.runtime.cli", "agentic RL with rollouts spilling onto serving devices (Ray runtime)"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "control-plane": ("rose.bench.control_plane", "the rollout manager's CPU per turn and token (fakes)"),
    "coserve": ("rose.bench.coserve", "serving P99 TTFT/TPOT beside rollouts: naive, static, rose"),
    "coserve-vllm": ("rose.bench.coserve_vllm", "co-serving on vLLM (dual-SLO scheduler) vs native"),
    "engine": ("rose.bench.engine", "ROSE engine vs transformers (and vLLM CPU) throughput"),
    "profile": ("rose.bench.profile", "where one engine iteration's time goes: decode and prefill"),
    "train": ("rose.bench.train", "rose train in fixed, elastic and rose modes side by side"),
    "rollout": ("rose.bench.rollout", "rose train's rollouts on the native engine and on vLLM side by side"),
    "transfer": ("rose.bench.transfer", "weight sync after AdamW steps: naive, shard-aware, sparse delta"),
    "soak": ("rose.bench.soak", "rose serve under trace, rollouts and misbehaving clients: 5xx, RSS, leaks"),
    "serve": ("rose.bench.serve", "rose serve against vllm serve on one core: the same two clients, one run"),
}


def _add_commands(parser: argparse.ArgumentParser, table: dict[str, tuple[str, str]],
                  dest: str, words: list[str]) -> None:
    """A subparser per entry; the chosen one (`words[0]`) is filled by its own module."""
    sub = parser.add_subparsers(dest=dest, required=True, metavar=dest.upper())
    for name, (module, help_text) in table.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Also after the command (`rose train --log-level debug`); SUPPRESS keeps the top level's.
        p.add_argument("--log-level", choices=logs.LEVELS, default=argparse.SUPPRESS,
                       help="diagnostic lines at this level and above (default: info)")
        if not words or name != words[0]:
            continue
        if name == "bench":
            _add_commands(p, BENCHES, "bench", words[1:])
        else:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of `rose`, with the options of the subcommand `argv` invokes."""
    parser = argparse.ArgumentParser(prog="rose", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version",
                        version=f"rose {importlib.metadata.version('rose-rl')}")
    parser.add_argument("--log-level", choices=logs.LEVELS, default=logs.DEFAULT_LEVEL,
                        help="diagnostic lines at this level and above, the Ray workers' too")
    table = {**COMMANDS, "bench": ("", "run a benchmark: rose bench NAME [--quick] --json OUT")}
    words = [a for i, a in enumerate(argv) if not a.startswith("-") and argv[i - 1:i] != ["--log-level"]]
    _add_commands(parser, table, "command", words)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Ray's default for a local instance (token authentication), chosen explicitly as Ray asks:
    # unset, every command that starts Ray prints a notice. Ray reads it as it is imported, and
    # its own processes read it as they start: once Ray is imported (a caller in this process),
    # changing it would set the two apart.
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    argv = sys.argv[1:] if argv is None else argv
    args = parser_for(argv).parse_args(argv)
    logs.configure(args.log_level)
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        # Bad input (config, file, request) is a one-line error, not a traceback.
        print(f"rose {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
