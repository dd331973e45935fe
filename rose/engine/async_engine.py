"""`AsyncLLMEngine`: a `GenerationEngine` (rose.contracts: the native `LLMEngine`, or vLLM's
`rose.engine.vllm_engine.VllmEngine`) on its own thread (`rose.steploop.StepLoop`), for asyncio
callers that stream requests and swap weights between two iterations."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Generic, TypeVar

import torch

from rose.contracts import GenerationEngine, InFlight, RequestOutput, SamplingParams
from rose.contracts.adapter import LoRAConfig
from rose.steploop import LoopDeadError, StepLoop

E = TypeVar("E", bound=GenerationEngine)


class AsyncLLMEngine(StepLoop[RequestOutput], Generic[E]):
    def __init__(self, engine: E) -> None:
        super().__init__(engine, name="rose-engine")
        self.engine = engine

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, gather_s: float = 0.0, adapter: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (see `StepLoop.stream`), with the loaded LoRA `adapter` if given."""
        rid = request_id or self.new_id("async")

        def add() -> None:
            self.engine.add_request(prompt_token_ids, params, rid, priority, adapter)

        return self.stream(rid, add, gather_s)

    async def ping(self, timeout_s: float) -> None:
        """The loop answers, and its engine can still run (`check_health`, on the loop's thread)."""
        await super().ping(timeout_s, self.engine.check_health)

    def check(self, timeout_s: float) -> None:
        """`ping` from outside the loop's thread (`StepLoop.check`): every engine's
        `check_health` only reads whether an iteration failed it."""
        super().check(timeout_s)
        try:
            self.engine.check_health()
        except RuntimeError as exc:
            raise LoopDeadError(f"{self.name}: {exc}") from None

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                           in_flight: InFlight | None = None) -> None:
        """`in_flight` None: the engine's own default."""
        load = self.engine.load_weights
        await self.call(lambda: load(named_tensors, version) if in_flight is None
                        else load(named_tensors, version, in_flight))

    async def load_adapter(self, name: str, config: LoRAConfig,
                           named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """`GenerationEngine.load_adapter` between two iterations."""
        await self.call(lambda: self.engine.load_adapter(name, config, named_tensors, version))

    async def remove_adapter(self, name: str) -> None:
        await self.call(lambda: self.engine.remove_adapter(name))
