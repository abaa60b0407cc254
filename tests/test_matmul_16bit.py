"""Past the C++ kernels' rows, a 16-bit CPU matmul runs where it is fast: oneDNN's own bf16
matmul on CPUs with AVX-512 BF16 / AMX, fp32 elsewhere (oneDNN emulates bf16 there, 3-4x
slower: `benchmarks/gemv_bench.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import quant


def test_the_kernels_give_way_to_a_matmul_past_their_rows() -> None:
    avx2 = quant._kernel_max_rows({"avx2", "fma", "f16c"})
    native = quant._kernel_max_rows({"avx2", "avx512f", "avx512_bf16"})
    assert (avx2["16-bit"], native["16-bit"]) == (64, 8)
    assert not quant._fast_16bit({"avx2", "avx512f"}) and quant._fast_16bit({"amx_bf16"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fast", [False, True])
def test_a_16bit_matmul_past_the_kernels_rows(
    dtype: torch.dtype, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a native 16-bit matmul: x and the weight in fp32, y rounded once to x's dtype
    (the same bits as that computed by hand); with one: oneDNN's 16-bit matmul itself. A
    quantized weight past its rows is decoded to fp32 for it, not rounded to 16 bits first."""
    monkeypatch.setattr(quant, "FAST_16BIT_MATMUL", fast)
    torch.manual_seed(0)
    rows = 200  # past the kernels' rows on any CPU
    w, bias = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    x = torch.randn(rows, 64).to(dtype)
    out = quant.linear(x, w, bias)
    if fast:
        expected = F.linear(x, w, bias)
    else:
        expected = F.linear(x.float(), w.float(), bias.float()).to(dtype)
    assert out.dtype == dtype and torch.equal(out, expected)

    q = quant.quantize_int8(w.float())
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS, 0))
    out = quant.linear(x, q, bias)
    xr = quant.round_activations(x)
    if fast:
        expected = F.linear(xr, q.dequantize(dtype), bias)
    else:
        expected = F.linear(xr.float(), q.dequantize(torch.float32), bias.float()).to(dtype)
    assert torch.equal(out, expected)
