"""The LoRA kernel workloads (lora/triton_ops.py) that the compile check records: the fused
q/k/v and the down projection of the shapes we claim, adapters of rank 16 and 64 (the fused
module's rank dimension 3 x 16 = 48 and 3 x 64 = 192), in fp16, bf16 and fp32, over a decode
batch and a prefill chunk of four adapters and base-model tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

# model -> (hidden, q + 2 kv rows, intermediate)
LORA_SHAPES = {"SmolLM2-135M": (576, 960, 1536), "Llama-3-8B": (4096, 6144, 14336)}
LORA_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
RANKS = (16, 64)
SLOTS = 4


def lora_launches(
    hidden: int, qkv: int, inter: int, rank: int, dtype: torch.dtype, device: str
) -> None:
    from pagedllm.lora.triton_ops import lora_bgmv_triton

    for tokens in (32, 300):
        slots = torch.arange(tokens, device=device) % (SLOTS + 1) - 1  # -1: the base model
        for k, m, parts in ((hidden, qkv, 3), (inter, hidden, 1)):
            r = parts * rank
            x = torch.zeros(tokens, k, dtype=dtype, device=device)
            out = torch.zeros(tokens, m, dtype=dtype, device=device)
            a = torch.zeros(SLOTS, r, k, dtype=dtype, device=device)
            b = torch.zeros(SLOTS, m, r, dtype=dtype, device=device)
            lora_bgmv_triton(out, x, a, b, slots)


def lora_workloads(device: str = "cpu") -> Iterator[tuple[str, Callable[[], None]]]:
    for model, (hidden, qkv, inter) in LORA_SHAPES.items():
        for rank in RANKS:
            for dname, dtype in LORA_DTYPES.items():

                def run(
                    h: int = hidden,
                    q: int = qkv,
                    i: int = inter,
                    r: int = rank,
                    dt: torch.dtype = dtype,
                ) -> None:
                    lora_launches(h, q, i, r, dt, device)

                yield f"LoRA {model} r{rank} {dname}", run
