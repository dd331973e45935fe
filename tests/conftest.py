from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rose.model import init_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen2", "tiny", tmp_path_factory.mktemp("tiny_qwen2"), seed=1)
