"""`AsyncLLMEngine`: an `LLMEngine` (or vLLM's, `rose.engine.vllm_engine.VllmEngine`, which has
its surface) on its own thread (`rose.steploop.StepLoop`), for asyncio callers that stream
requests and swap weights between two iterations."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import torch

from rose.contracts import SamplingParams
from rose.engine.llm_engine import InFlight, LLMEngine
from rose.engine.sequence import RequestOutput
from rose.engine.vllm_engine import VllmEngine
from rose.steploop import StepLoop


class AsyncLLMEngine(StepLoop[RequestOutput]):
    def __init__(self, engine: LLMEngine | VllmEngine) -> None:
        super().__init__(engine, name="rose-engine")
        self.engine = engine

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (see `StepLoop.stream`)."""
        rid = request_id or self.new_id("async")
        return self.stream(rid, lambda: self.engine.add_request(prompt_token_ids, params, rid, priority))

    async def ping(self, timeout_s: float) -> None:
        """The loop answers, and its engine can still run (`check_health`, on the loop's thread)."""
        await super().ping(timeout_s, self.engine.check_health)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                           in_flight: InFlight = InFlight.CONTINUE) -> None:
        await self.call(lambda: self.engine.load_weights(named_tensors, version, in_flight))
