"""Compile the Triton attention kernel for a CUDA target, with no GPU: what only the compiled path
checks (tl.dot's shapes, types, registers) fails here as it would on the device. Run by
tests/engine/test_engine_attention.py as `python tests/triton_compile.py` with TRITON_INTERPRET unset."""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget

from rose.engine.triton_attention import PREFILL_TILE, _paged_attention, constants

TENSORS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr")  # in the model's dtype; the plan's are int32
TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}
# (heads, KV heads, block, head dim): the tiny test model's, SmolLM2's, a Qwen3-8B's, small blocks.
SHAPES = [(4, 2, 16, 16), (9, 3, 16, 64), (32, 8, 16, 128), (6, 2, 4, 16)]


def _type(name: str, pointer: str, consts: dict[str, object]) -> str:
    if name in consts:
        return "constexpr"
    if name in TENSORS:
        return pointer
    return {"tables_ptr": "*i32", "tiles_ptr": "*i32", "scale": "fp32"}.get(name, "i64")  # strides


def main() -> None:
    target = GPUTarget("cuda", 90, 32)  # Hopper: the H100/H200 the GPU checks run on
    for dtype, pointer in TYPES.items():
        for heads, kv_heads, block, dim in SHAPES:
            for block_m in (1, PREFILL_TILE):
                consts = constants(dtype, heads, kv_heads, block, dim, block_m)
                signature = {name: _type(name, pointer, consts) for name in _paged_attention.arg_names}
                kernel = triton.compile(triton.compiler.ASTSource(_paged_attention, signature, consts),
                                        target=target)
                assert kernel.asm["cubin"], (dtype, heads, kv_heads, block, dim, block_m)
    print("compiled")


if __name__ == "__main__":
    main()
