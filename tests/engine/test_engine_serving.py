"""The engine's limits as the HTTP server applies them: the default max_tokens fits the KV
pool, and a request past it is a 400 that names the numbers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from rose.coserve.executor import CoServingExecutor
from rose.coserve.server import build_app
from rose.coserve.settings import MB, ExecutorConfig
from rose.engine import KVSpec
from rose.model import init_model, load_model, load_tokenizer
from rose.steploop import StepLoop

PAGES = 12


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, CoServingExecutor]]:
    root = tmp_path_factory.mktemp("serve")
    serving = init_model("qwen2", "tiny", root / "serving", seed=1)
    rollout = init_model("qwen3", "tiny", root / "rollout", seed=2)
    page = max(KVSpec.of(load_model(p).config).block_bytes for p in (serving, rollout))
    executor = CoServingExecutor.from_pretrained(serving, rollout, ExecutorConfig(pool_mb=PAGES * page / MB))
    with TestClient(build_app(StepLoop(executor), executor, load_tokenizer(serving), "tiny")) as client:
        yield client, executor


@pytest.mark.timeout(300)
def test_the_default_max_tokens_fits_the_kv_pool(app: tuple[TestClient, CoServingExecutor]) -> None:
    client, executor = app
    limit = executor.serving.max_request_tokens
    assert limit == PAGES * 16 + 1 < executor.serving.max_model_len
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "temperature": 0,
                                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["total_tokens"] == limit
    too_long = client.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 100,
                                                     "max_tokens": 200})
    assert too_long.status_code == 400
    assert "the KV pool holds 12 pages" in too_long.json()["error"]["message"]
