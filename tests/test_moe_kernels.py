"""The experts of a MoE layer in one C++ call on the CPU (csrc/moe.cpp via
`layers.moe_cpu.fused_experts_cpu`) against the per-expert loop `experts_loop` (itself on the
same linear kernels, so quantized weights meet the same int8-rounded activations), and, for a
Mixtral-style and a gpt-oss layer, against transformers' own experts modules as an independent
oracle: every weight format, activation, with and without biases, 1 to 33 tokens (1 to 70 on
one expert), top-1 to top-8, experts without tokens and a token routed twice to one expert."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedllm.layers import moe_cpu, quant
from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.moe import ACTIVATIONS, Experts, experts_loop
from pagedllm.layers.moe_cpu import fused_experts_cpu

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernel_available(), reason="the CPU extension does not build here"
)

E, H, INTER = 10, 352, 160  # experts (some get no token at top-1), hidden, per expert:
# several tiles of rows of each weight, some partial (csrc/moe.cpp `tile_rows`)


@pytest.fixture
def every_row_count(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The linear kernels (in experts_loop) and fused_moe for any number of rows."""
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS))
    yield


def stacked(w: torch.Tensor, fmt: str) -> quant.Weight:
    """(E, N, K) fp32 in `fmt` ("fp32", "bf16", "int8" per channel, "q8_0" int8 in groups of
    32, "int4"): quantized expert by expert, stacked on a leading expert dim."""
    if fmt in ("fp32", "bf16"):
        return w.to(torch.bfloat16 if fmt == "bf16" else torch.float32)
    if fmt == "q8_0":
        parts = [quant.quantize_int8(w[e], 32) for e in range(w.shape[0])]
    else:
        parts = [quant.quantize(w[e], fmt) for e in range(w.shape[0])]
    mins = [p.mins for p in parts if p.mins is not None]
    return quant.QuantizedWeight(
        parts[0].bits,
        torch.stack([p.qweight for p in parts]),
        torch.stack([p.scales for p in parts]),
        torch.stack(mins) if mins else None,
    )


def make_experts(fmt: str, activation: str, bias: bool, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    b13 = torch.randn(E, 2 * INTER, generator=g).to(dtype) if bias else None
    b2 = torch.randn(E, H, generator=g).to(dtype) if bias else None
    return Experts(stacked(w13, fmt), stacked(w2, fmt), b13, b2, activation, limit=1.5)


def routing(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k over random logits: (N, k) fp32 weights, int64 ids."""
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.softmax(torch.randn(n, E, generator=g), -1).topk(k, -1)
    return weights, ids


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def fused(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
    out = fused_experts_cpu(x, w, ids, experts)
    assert out is not None, "the kernel refused it"
    assert out.dtype == x.dtype and out.shape == x.shape
    return out


@pytest.mark.usefixtures("every_row_count")
@pytest.mark.parametrize("n,k,bias", [(1, 1, True), (5, 2, False), (33, 8, True)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "q8_0", "int4"])
def test_matches_the_loop(fmt: str, activation: str, n: int, k: int, bias: bool) -> None:
    """fp32 and quantized weights: the loop's result up to the summation order (and, for
    quantized ones, a rare activation rounded to the neighbouring int8). bf16: the loop in
    fp32 on the same bf16 values, to one rounding of the output (the kernel keeps gate_up, h
    and y in fp32, where the loop rounds each to bf16)."""
    experts = make_experts(fmt, activation, bias)
    weights, ids = routing(n, k)
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(1))
    if fmt == "bf16":
        x = x.bfloat16()
        b13, b2 = experts.b13, experts.b2
        assert isinstance(experts.w13, torch.Tensor) and isinstance(experts.w2, torch.Tensor)
        exact = Experts(
            experts.w13.float(),
            experts.w2.float(),
            None if b13 is None else b13.float(),
            None if b2 is None else b2.float(),
            activation,
            experts.limit,
        )
        expected = experts_loop(x.float(), weights, ids, exact)
        tol = 2**-8
    else:
        expected = experts_loop(x, weights, ids, experts)
        tol = 1e-5 if fmt == "fp32" else 1e-3
    assert rel_err(fused(x, weights, ids, experts), expected) < tol


@pytest.mark.usefixtures("every_row_count")
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_every_row_count_of_one_expert(fmt: str) -> None:
    """1..70 tokens on one expert (and one each on two others): every edge of the register
    tiles (csrc/moe_gemm.cpp: up to 6 rows of x per pass on AVX-512, 3 on AVX2, the rows split
    evenly between passes) and of the quantized kernels' blocks, at widths that are odd
    multiples of 32 (hidden 160, 96 per expert: 10 and 6 vectors of 16 lanes)."""
    h, inter, e = 160, 96, 4
    g = torch.Generator().manual_seed(4)
    w13 = stacked(torch.randn(e, 2 * inter, h, generator=g) / h**0.5, fmt)
    w2 = stacked(torch.randn(e, h, inter, generator=g) / inter**0.5, fmt)
    b13 = None if fmt == "bf16" else torch.randn(e, 2 * inter, generator=g)
    experts = Experts(w13, w2, b13, None, "silu")
    x_all = torch.randn(72, h, generator=g)
    for n in range(1, 71):
        ids = torch.full((n + 2, 1), 2, dtype=torch.int64)
        ids[0, 0], ids[-1, 0] = 0, 3
        weights = torch.rand(n + 2, 1, generator=g)
        x = x_all[: n + 2]
        if fmt == "bf16":  # the loop on the same bf16 values in fp32: one rounding apart
            assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
            exact = Experts(w13.float(), w2.float(), None, None, "silu")
            expected, tol = experts_loop(x.bfloat16().float(), weights, ids, exact), 2**-8
            out = fused(x.bfloat16(), weights, ids, experts)
        else:
            expected = experts_loop(x, weights, ids, experts)
            tol = 1e-5 if fmt == "fp32" else 1e-3
            out = fused(x, weights, ids, experts)
        assert rel_err(out, expected) < tol, n


@pytest.mark.usefixtures("every_row_count")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_with_16bit_activations(fmt: str) -> None:
    """bf16 x with quantized experts: the loop in bf16 (which rounds gate_up, h and y to
    bf16, the kernel once at the end)."""
    experts = make_experts(fmt, "silu", bias=True)
    weights, ids = routing(9, 4)
    x = torch.randn(9, H).bfloat16()
    assert rel_err(fused(x, weights, ids, experts), experts_loop(x, weights, ids, experts)) < 2**-6


@pytest.mark.usefixtures("every_row_count")
def test_awkward_routing() -> None:
    """A token sent twice to one expert (both weighted outputs count), experts without any
    token, int32 ids and fp16 x; no tokens at all gives an empty output."""
    experts = make_experts("fp32", "silu", bias=True)
    ids = torch.tensor([[3, 3, 7], [7, 0, 3], [9, 9, 9]], dtype=torch.int32)
    weights = torch.rand(3, 3)
    x = torch.randn(3, H)
    expected = experts_loop(x, weights, ids.long(), experts)
    assert rel_err(fused(x, weights, ids, experts), expected) < 1e-5
    half = experts_loop(x.half(), weights, ids.long(), experts)
    assert rel_err(fused(x.half(), weights, ids, experts), half) < 2**-8
    mixed = Experts(stacked(experts.w13, "int8"), experts.w2, experts.b13, experts.b2)  # type: ignore[arg-type]
    assert rel_err(fused(x, weights, ids, mixed), experts_loop(x, weights, ids, mixed)) < 1e-3
    empty = fused(x[:0], weights[:0], ids[:0], experts)
    assert empty.shape == (0, H)
    with pytest.raises(RuntimeError, match="expert id"):
        fused_experts_cpu(x, weights, torch.full((3, 3), E), experts)


def test_refuses_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """None (the caller runs experts_loop): fp64 x, a hidden size not a multiple of 32, a
    non-contiguous weight, an unknown activation, and an expert with more tokens than the
    kernels' rows."""
    experts = make_experts("fp32", "silu", bias=False)
    weights, ids = routing(4, 2)
    x = torch.randn(4, H)
    assert fused_experts_cpu(x.double(), weights, ids, experts) is None
    assert isinstance(experts.w13, torch.Tensor) and isinstance(experts.w2, torch.Tensor)
    odd = Experts(experts.w13[:, :, :80].contiguous(), experts.w2[:, :80].contiguous())
    assert fused_experts_cpu(x[:, :80], weights, ids, odd) is None
    strided = Experts(experts.w13.transpose(1, 2).contiguous().transpose(1, 2), experts.w2)
    assert fused_experts_cpu(x, weights, ids, strided) is None
    assert (
        fused_experts_cpu(x, weights, ids, Experts(experts.w13, experts.w2, activation="relu"))
        is None
    )
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS, 1))
    n = max(moe_cpu.MIN_KERNEL_ROWS, moe_cpu.FP32_AVX512_ROWS) + 1  # on expert 0: past the
    crowded = torch.zeros(n, 1, dtype=torch.int64)  # rows of any CPU
    assert fused_experts_cpu(torch.randn(n, H), torch.ones(n, 1), crowded, experts) is None
    assert fused_experts_cpu(x, weights, ids, experts) is not None  # 4 rows: taken


def transformers_oracle(kind: str) -> tuple[torch.nn.Module, Experts]:
    """transformers' MixtralExperts (silu, gate rows then up rows, no bias) or GptOssExperts
    (clamped SwiGLU, gate and up columns interleaved in a (E, H, 2I) gate_up, biases) with
    random weights, and the same weights as our Experts."""
    from transformers import GptOssConfig, MixtralConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(2)
    if kind == "mixtral":
        mixtral_config = MixtralConfig(
            hidden_size=H, intermediate_size=INTER, num_local_experts=E, hidden_act="silu"
        )
        mixtral_config._experts_implementation = "eager"  # a standalone module: no dispatch
        mixtral = MixtralExperts(mixtral_config)
        for p in mixtral.parameters():
            torch.nn.init.normal_(p, std=0.1)
        return mixtral, Experts(mixtral.gate_up_proj.data, mixtral.down_proj.data)
    config = GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E)
    config._experts_implementation = "eager"
    oss = GptOssExperts(config)
    for p in oss.parameters():
        torch.nn.init.normal_(p, std=0.3)
    gate_up, bias = oss.gate_up_proj.data, oss.gate_up_proj_bias.data  # (E, H, 2I), (E, 2I)
    w13 = torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), -1).transpose(1, 2).contiguous()
    b13 = torch.cat((bias[:, ::2], bias[:, 1::2]), -1)
    w2 = oss.down_proj.data.transpose(1, 2).contiguous()
    experts = Experts(w13, w2, b13, oss.down_proj_bias.data, "swiglu_oai", config.swiglu_limit)
    return oss, experts


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_matches_transformers(kind: str) -> None:
    module, experts = transformers_oracle(kind)
    weights, ids = routing(7, 4, seed=3)
    x = torch.randn(7, H)
    with torch.no_grad():
        expected = module(x, ids, weights)
    assert rel_err(fused(x, weights, ids, experts), expected) < 1e-5
