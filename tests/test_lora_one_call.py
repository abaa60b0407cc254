"""A step's LoRA adapters on the one-call decode path: csrc/decoder.cpp's `decode_layers` adds
each adapted linear's deltas by lora.cpp's BGMV, after the same kernels in the same order as
the op-by-op loop (lora/ops.py's LoraStep.add), so the same bits, fp32 and bf16, with the base
model's token of the batch untouched. Token-exact with PEFT through the engine:
tests/test_lora.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_decode_layers import FEATURES, decode_steps, same_bits, tiny_config, tiny_model

from pagedllm.layers import quant
from pagedllm.layers.attention import cpu_kernels
from pagedllm.lora.ops import LoraStep, lora_reference
from pagedllm.model.decoder import CausalLM

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernel_available(), reason="the CPU extension does not build here"
)

# decode_steps' three requests: the adapters in slots 2 and 0, and the base model
TOKEN_SLOTS = [2, -1, 0]
RANKS = (2, 8, 4)  # each slot's rank, in a pool of rank 8
# which slots adapt which module: o only by slot 1, which the step lacks (skipped); down only
# by slot 2
ADAPTS = {
    "qkv": [True, False, True],
    "o": [False, True, False],
    "gate_up": [True, True, False],
    "down": [False, False, True],
}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, bool]]]:
    """The kernels for every row count; each decode_layers call's rows and whether it was
    given a LoRA."""
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS))
    module = cpu_kernels.kernel_module()
    seen: list[tuple[int, bool]] = []
    real = module.decode_layers

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((x.shape[0], bool(args[-3])))
        return real(x, *args)

    monkeypatch.setattr(module, "decode_layers", counted)
    yield seen


def random_lora(model: CausalLM, adapts: dict[str, list[bool]]) -> LoraStep:
    """A pool of three slots of random adapters (ranks RANKS) in every layer and module, as
    lora/slots.py lays it out: A (slots, parts * R, in), B (slots, out, parts * R), part j's
    rank-r block at A's rows [j R, j R + r) and B's rows of part j, columns [j R, j R + r),
    zeros elsewhere."""
    cfg, dtype = model.config, model.norm.weight.dtype
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    d, i, r = cfg.hidden_size, cfg.intermediate_size, max(RANKS)
    shapes = {"qkv": (q + 2 * kv, d), "o": (d, q), "gate_up": (2 * i, d), "down": (d, i)}
    parts = {"qkv": [0, q, q + kv], "o": [0], "gate_up": [0, i], "down": [0]}
    gen = torch.Generator().manual_seed(1)
    weights = []
    for _ in range(cfg.num_layers):
        layer = {}
        for module, (out, inp) in shapes.items():
            rows = [*parts[module], out]
            a = torch.zeros(len(RANKS), len(rows[1:]) * r, inp)
            b = torch.zeros(len(RANKS), out, len(rows[1:]) * r)
            for slot, rank in enumerate(RANKS):
                for j, (start, end) in enumerate(itertools.pairwise(rows)):
                    cols = slice(j * r, j * r + rank)
                    a[slot, cols] = torch.randn(rank, inp, generator=gen) * 0.1
                    b[slot, start:end, cols] = torch.randn(end - start, rank, generator=gen) * 0.1
            layer[module] = (a.to(dtype), b.to(dtype))
        weights.append(layer)
    return LoraStep.create(weights, TOKEN_SLOTS, adapts, torch.device("cpu"), parts)


def fused_and_op_by_op(
    model: CausalLM, calls: list[tuple[int, bool]], lora: LoraStep | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    calls.clear()
    fused = decode_steps(model, lora=lora)
    assert calls == [(3, lora is not None)] * 3, "the steps did not go through decode_layers"
    kernel_weights, model._kernel_weights = model._kernel_weights, []
    op_by_op = decode_steps(model, lora=lora)
    model._kernel_weights = kernel_weights
    assert len(calls) == 3
    return fused, op_by_op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("feature", ["llama", "gemma3_like", "olmo2_like"])
def test_lora_one_call_equals_op_by_op(
    feature: str, dtype: torch.dtype, calls: list[tuple[int, bool]]
) -> None:
    """Two adapters of different ranks and targets and the base model in one decode step
    (a module no adapter of the step adapts skipped): the same bits — logits and KV caches —
    as op by op; the adapters' tokens changed, the base model's not."""
    model = tiny_model(tiny_config(**(FEATURES[feature][0] if feature in FEATURES else {})), dtype)
    lora = random_lora(model, ADAPTS)
    assert lora.skip == {"o"}
    fused, op_by_op = fused_and_op_by_op(model, calls, lora)
    assert same_bits(fused, op_by_op)
    base, _ = fused_and_op_by_op(model, calls, None)
    for step, step_base in zip(fused[:3], base[:3], strict=True):
        assert not torch.equal(step[0], step_base[0]) and not torch.equal(step[2], step_base[2])
        assert torch.equal(step[1], step_base[1])  # the base model's token


@pytest.mark.parametrize("module", list(ADAPTS))
def test_each_module_delta_counts(module: str, calls: list[tuple[int, bool]]) -> None:
    """Each module's deltas alone change the one-call logits, and as op by op (a kernel that
    dropped one, or added a skipped one, would not match)."""
    model = tiny_model(tiny_config(), torch.float32)
    only = {m: [m == module] * len(RANKS) for m in ADAPTS}
    fused, op_by_op = fused_and_op_by_op(model, calls, random_lora(model, only))
    assert same_bits(fused, op_by_op)
    base, _ = fused_and_op_by_op(model, calls, None)
    assert not torch.equal(fused[0][0], base[0][0]), f"{module}'s deltas change nothing"


def test_parts_equal_the_whole_block_diagonal_b() -> None:
    """lora_bgmv given a fused module's parts reads only B's diagonal blocks: the same deltas
    as the per-token reference over the whole B, fp32."""
    lora = random_lora(tiny_model(tiny_config(), torch.float32), ADAPTS)
    for module in ("qkv", "gate_up"):
        a, b = lora.weights[0][module]
        x = torch.randn(len(TOKEN_SLOTS), a.shape[2], generator=torch.Generator().manual_seed(2))
        out = torch.zeros(len(TOKEN_SLOTS), b.shape[1])
        lora.add(0, module, x, out)
        want = lora_reference(x, a, b, lora.token_slots)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("parts", [[], [0, 60]], ids=["one_part", "two_parts"])
def test_kernel_rank_tiles_and_token_alone(dtype: torch.dtype, parts: list[int]) -> None:
    """lora_bgmv past a SIMD register's rank (B's blocks of rows transposed in registers, the
    rest of the rank and of the rows by the scalar tail), a slot of many tokens and slots of
    one: the per-token reference's deltas, and each token's deltas the same bits alone as in
    the mixed call; a slot past the pool refused."""
    gen = torch.Generator().manual_seed(3)
    slots, rank, d_in, d_out = 3, 40, 48, 100
    a = torch.randn(slots, rank, d_in, generator=gen) * 0.1
    b = torch.randn(slots, d_out, rank, generator=gen) * 0.1
    if parts:  # block-diagonal, as lora/slots.py lays a fused module out
        b[:, : parts[1], rank // 2 :] = 0
        b[:, parts[1] :, : rank // 2] = 0
    a, b = a.to(dtype), b.to(dtype)
    token_slots = torch.tensor([1, 0, 1, -1, 2] + [1] * 18)
    x = torch.randn(len(token_slots), d_in, generator=gen).to(dtype)
    kernel = cpu_kernels.kernel_module()
    out = torch.zeros(len(token_slots), d_out, dtype=dtype)
    assert kernel.lora_bgmv(out, x, a, b, token_slots, parts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = lora_reference(x, a, b, token_slots)
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    for n in range(len(token_slots)):
        alone = torch.zeros(1, d_out, dtype=dtype)
        assert kernel.lora_bgmv(alone, x[n : n + 1], a, b, token_slots[n : n + 1], parts)
        assert torch.equal(alone[0], out[n])
    assert not kernel.lora_bgmv(out, x, a, b, torch.full_like(token_slots, slots), parts)
