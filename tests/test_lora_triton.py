"""The LoRA Triton kernels (lora/triton_ops.py), run by the Triton interpreter on CPU tensors,
against each token alone (lora/ops.py `lora_reference`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.lora.ops import lora_reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")


@pytest.mark.parametrize(
    ("dtype", "rank", "d_in", "d_out"),
    [(torch.float32, 12, 40, 72), (torch.bfloat16, 6, 64, 33), (torch.float16, 48, 24, 160)],
)
def test_triton_deltas_equal_the_reference(
    dtype: torch.dtype, rank: int, d_in: int, d_out: int
) -> None:
    from pagedllm.lora.triton_ops import lora_bgmv_triton

    gen = torch.Generator().manual_seed(1)
    slots = 3
    a = (torch.randn(slots, rank, d_in, generator=gen) * 0.3).to(dtype)
    b = (torch.randn(slots, d_out, rank, generator=gen) * 0.3).to(dtype)
    token_slots = torch.tensor([1, -1, 0, 0, 2, -1, 1, 2, 2])
    x = torch.randn(len(token_slots), d_in, generator=gen).to(dtype)
    base = torch.randn(len(token_slots), d_out, generator=gen).to(dtype)
    out = base.clone()
    lora_bgmv_triton(out, x, a, b, token_slots)
    want = base.float() + lora_reference(x, a, b, token_slots)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    base_rows = token_slots < 0
    assert torch.equal(out[base_rows], base[base_rows])  # base-model tokens untouched
