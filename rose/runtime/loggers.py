"""Where each step's record goes as the step ends: the loggers named by `train.logger`.

- console: one line per step on the terminal;
- jsonl: `metrics.jsonl` in `train.out_dir`, one JSON object per step (`TrainStep.record()`),
  flushed as it is written, so a killed run keeps every step it finished;
- tensorboard: event files in `train.out_dir/tensorboard` (needs the `tensorboard` package);
- wandb: a run in `train.out_dir/wandb` (needs `wandb`; `WANDB_MODE=offline` needs no network).

TensorBoard and wandb get the record's numbers as `scalars` names them: `trainer/kl`,
`serving/slo_attainment`, `rollout_s`, ... at the step's index.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rose.runtime.config import Config, ServingDeviceConfig

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # the optional loggers' packages
METRICS_FILE = "metrics.jsonl"


def missing_package(logger: str) -> str | None:
    """The package `logger` needs that is not installed here, if any."""
    package = PACKAGES.get(logger)
    return package if package is not None and importlib.util.find_spec(package) is None else None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers, a nested dict's as `key/inner` (None, text and lists left out)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in scalars(value).items()})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class StepLogger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class ConsoleLogger:
    def __init__(self, serving: ServingDeviceConfig) -> None:
        from rich.console import Console

        # One line per step, however wide: the terminal wraps it, and a log file keeps it whole.
        self.console, self.serving = Console(soft_wrap=True), serving

    def log(self, r: dict[str, Any]) -> None:
        s, h, t, slo = r["serving"], r["heldout_success"], r["trainer"], self.serving.executor
        serving = (f" | serving p99 TTFT {s.get('p99_ttft_ms')} / {slo.slo_ttft_ms:g} ms, "
                   f"TPOT {s.get('p99_tpot_ms')} / {slo.slo_tpot_ms:g} ms, "
                   f"SLO {s.get('slo_attainment')}") if s else ""
        heldout = "" if h is None else f" held-out {h:.2f} ({r['eval_s']:.1f}s)"
        self.console.print(
            f"[bold]step {r['step']}[/] reward {t['reward_mean']:+.3f} "
            f"success {r['success_rate']:.2f}{heldout} "
            f"| loss {t['loss']:+.4f} kl {t['kl']:.4f} entropy {t['entropy']:.3f} "
            f"grad {t['grad_norm']:.3f} lr {t['lr']:.2e} | rollout {r['rollout_s']:.1f}s "
            f"train {r['train_s']:.1f}s step {r['step_s']:.1f}s | on serving {r['serving_token_share']:.0%} "
            f"resumed {r['resumed_turns']} | sync {r['sync_bytes'] / 1e6:.2f} MB {r['sync_s']:.2f}s{serving}")

    def close(self) -> None:
        pass


class JsonlLogger:
    def __init__(self, path: Path, first_step: int = 0) -> None:
        """Append to `path`, keeping the records of steps before `first_step` (those a resumed run
        does not run again; a fresh run starts at 0 and keeps none)."""
        kept = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < first_step:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):  # the torn last line of a killed run
                    continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)  # a crash here leaves the old file or the new, never half of one
        self.file = path.open("a")

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # in the kernel's hands: a killed run loses no finished step

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        tags = scalars(record)
        step = int(tags.pop("step"))
        for tag, value in tags.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, out_dir: Path, config: Config) -> None:
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project="rose", name=out_dir.name, dir=str(out_dir),
                              config=dataclasses.asdict(config))

    def log(self, record: dict[str, Any]) -> None:
        tags = scalars(record)
        self.run.log(tags, step=int(tags.pop("step")))

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """The config's loggers; each step's record goes to every one."""

    def __init__(self, config: Config, first_step: int = 0) -> None:
        out = Path(config.train.out_dir)
        make = {"console": lambda: ConsoleLogger(config.serving),
                "jsonl": lambda: JsonlLogger(out / METRICS_FILE, first_step),
                "tensorboard": lambda: TensorBoardLogger(out / "tensorboard"),
                "wandb": lambda: WandbLogger(out, config)}
        self.loggers: list[StepLogger] = [make[name]() for name in config.train.logger]

    def log(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
