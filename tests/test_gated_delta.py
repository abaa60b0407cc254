"""The Gated-DeltaNet kernels (layers/gated_delta.py: the CPU path; gated_delta_triton.py under
the Triton interpreter) against transformers' own torch functions (Qwen3.5's
`causal_conv1d_fn` / `causal_conv1d_update`, `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`), one request at a time.

Varlen steps of 1-4 requests (decodes first, then prefills; new requests and continued ones;
a prefill shorter than the conv window; slots out of order in a larger pool), a prefill split
at arbitrary points equal to the whole prefill, decode steps after it equal to HF's recurrent
form, fp32 and bf16, GQA (2 value heads per key head), head dims that are not powers of two.

The C++ decode kernels (csrc/gated_delta.cpp, the CPU path's default) against the torch step
(`kernel=False`) and HF's recurrent rule: fp32 / bf16 / fp16, 2-4 value heads per key head,
Dv a multiple of the SIMD width or not, slots out of order, a new request among them.

Tolerances: fp32 1e-4 (the chunked form's triangular solve against the oracle's; the states
match to ~1e-6); bf16 inputs and outputs 2e-2 (the oracle rounds the conv output once more).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from pagedllm.layers import gated_delta as gd
from pagedllm.layers import gated_delta_triton as gdt
from pagedllm.layers.attention import cpu_kernels as kernels
from pagedllm.layers.gdn_meta import GdnMeta

SHAPE = gd.GdnShape(key_heads=2, value_heads=4, key_dim=32, value_dim=24, conv_kernel=4)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
POOL = 6


class Layer:
    """A layer's GDN parameters (random) and the step through either implementation."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        c, hv = SHAPE.conv_dim, SHAPE.value_heads
        self.dtype = dtype
        self.weight = (torch.randn(c, SHAPE.conv_kernel, generator=gen) * 0.5).to(dtype)
        self.a_log = torch.rand(hv, generator=gen).log()
        self.dt_bias = torch.randn(hv, generator=gen)

    def inputs(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        mixed = torch.randn(n, SHAPE.conv_dim, generator=gen).to(self.dtype)
        a = torch.randn(n, SHAPE.value_heads, generator=gen).to(self.dtype)
        b = torch.randn(n, SHAPE.value_heads, generator=gen).to(self.dtype)
        return mixed, a, b

    def step(self, impl: str, state: gd.GdnState, meta: GdnMeta, mixed, a, b) -> torch.Tensor:
        g, beta = gd.gdn_gating(a, b, self.a_log, self.dt_bias)
        if impl == "triton":
            conv = gdt.causal_conv1d_triton(mixed, self.weight, None, state.conv, meta, "silu")
            q, k, v = SHAPE.split(conv)
            return gdt.gated_delta_triton(q, k, v, g, beta, state.ssm, meta, True)
        conv = gd.causal_conv1d(mixed, self.weight, None, state.conv, meta)
        q, k, v = SHAPE.split(conv)
        return gd.gated_delta_rule(q, k, v, g, beta, state.ssm, meta)

    def oracle(self, conv_state, ssm_state, mixed, a, b, recurrent: bool = False):
        """HF on one request: (o (L, Hv, Dv), conv state, ssm state); None states: new."""
        x = mixed.t()[None]  # (1, C, L)
        if conv_state is None:
            conv = hf.causal_conv1d_fn(x, self.weight, None, "silu")
            pad = torch.nn.functional.pad(x, (SHAPE.conv_kernel - 1, 0))
            conv_state = pad[0, :, -(SHAPE.conv_kernel - 1) :]
        else:
            conv_state = conv_state.clone()[None]
            conv = hf.causal_conv1d_update(x, conv_state, self.weight, None, "silu")
            conv_state = conv_state[0]
        q, k, v = SHAPE.split(conv[0].t())
        g, beta = gd.gdn_gating(a, b, self.a_log, self.dt_bias)
        rule = hf.torch_recurrent_gated_delta_rule if recurrent else hf.torch_chunk_gated_delta_rule
        init = None if ssm_state is None else ssm_state[None].clone()
        o, h = rule(
            q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=init,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return o[0], conv_state, h[0]


def random_state(dtype: torch.dtype, seed: int = 1) -> gd.GdnState:
    gen = torch.Generator().manual_seed(seed)
    state = SHAPE.new_state(POOL, dtype)
    state.conv.copy_(torch.randn(state.conv.shape, generator=gen))
    state.ssm.copy_(torch.randn(state.ssm.shape, generator=gen) * 0.3)
    return state


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


IMPLS = ["cpu", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
# (tokens, slot, continues): decodes first (one of them a new 1-token prompt), then a prefill
# shorter than the conv window, a new one crossing a chunk, a continued one
STEPS = {
    "decodes": [(1, 4, True), (1, 0, True), (1, 2, False)],
    "prefills": [(2, 3, True), (70, 1, False), (9, 5, True)],
    "mixed": [(1, 5, True), (1, 0, False), (3, 2, True), (66, 4, True)],
    "single": [(130, 3, False)],
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(STEPS))
def test_varlen_step_matches_hf(impl: str, dtype: torch.dtype, kind: str) -> None:
    if impl == "triton" and kind == "single":
        pytest.skip("the interpreter's recurrent pass is slow; the split test covers 150 tokens")
    requests = STEPS[kind]
    layer, state = Layer(dtype), random_state(dtype)
    before = gd.GdnState(state.conv.clone(), state.ssm.clone())
    starts = [0]
    for n, _, _ in requests:
        starts.append(starts[-1] + n)
    meta = GdnMeta.build(starts, [s for _, s, _ in requests], [c for _, _, c in requests])
    mixed, a, b = layer.inputs(starts[-1], seed=2)
    out = layer.step(impl, state, meta, mixed, a, b)
    assert out.shape == (starts[-1], SHAPE.value_heads, SHAPE.value_dim) and out.dtype == dtype
    for r, (_, slot, cont) in enumerate(requests):
        s, e = starts[r], starts[r + 1]
        prev = (before.conv[slot], before.ssm[slot]) if cont else (None, None)
        o, conv, h = layer.oracle(*prev, mixed[s:e], a[s:e], b[s:e])
        close(out[s:e], o, dtype)
        assert torch.equal(state.conv[slot], conv.to(dtype)), (r, "conv state")
        close(state.ssm[slot], h, dtype)  # bf16: from the rounded conv outputs
    untouched = sorted(set(range(POOL)) - {slot for _, slot, _ in requests})
    assert torch.equal(state.ssm[untouched], before.ssm[untouched])
    assert torch.equal(state.conv[untouched], before.conv[untouched])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_split_prefill_then_decodes_match_whole_prefill(impl: str, dtype: torch.dtype) -> None:
    """A 150-token prompt in chunks of 37 / 63 / 50 (slot 4, stale contents first), then 3
    decode steps, against HF's whole chunked prefill then its recurrent decode steps."""
    layer, state = Layer(dtype, seed=3), random_state(dtype)
    mixed, a, b = layer.inputs(153, seed=4)
    outs = []
    for s, e in [(0, 37), (37, 100), (100, 150), (150, 151), (151, 152), (152, 153)]:
        meta = GdnMeta.build([0, e - s], [4], [s > 0])
        outs.append(layer.step(impl, state, meta, mixed[s:e], a[s:e], b[s:e]))
    o, conv, h = layer.oracle(None, None, mixed[:150], a[:150], b[:150])
    close(torch.cat(outs[:3]), o, dtype)
    for t in range(150, 153):
        o, conv, h = layer.oracle(conv, h, mixed[t : t + 1], a[t : t + 1], b[t : t + 1], True)
        close(outs[t - 147], o, dtype)
    assert torch.equal(state.conv[4], conv.to(dtype))
    close(state.ssm[4], h, dtype)


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu", "triton"])
def test_decode_entry_points(device_path: bool) -> None:
    """`causal_conv1d_update` / `gated_delta_decode` (a decode batch, slots out of order)
    equal the varlen functions over the same batch."""
    layer = Layer(torch.float32, seed=5)
    slots = [3, 0, 5]
    mixed, a, b = layer.inputs(3, seed=6)
    meta = GdnMeta.build([0, 1, 2, 3], slots, [True] * 3)
    ref_state, state = random_state(torch.float32), random_state(torch.float32)
    expected = layer.step("cpu", ref_state, meta, mixed, a, b)
    idx = torch.tensor(slots, dtype=torch.int32)
    g, beta = gd.gdn_gating(a, b, layer.a_log, layer.dt_bias)
    if device_path:
        conv = gdt.causal_conv1d_triton(mixed, layer.weight, None, state.conv, meta, "silu")
        q, k, v = SHAPE.split(conv)
        out = gdt.gated_delta_triton(q, k, v, g, beta, state.ssm, meta, True)
    else:
        conv = gd.causal_conv1d_update(mixed, layer.weight, None, state.conv, idx)
        q, k, v = SHAPE.split(conv)
        out = gd.gated_delta_decode(q, k, v, g, beta, state.ssm, idx)
    close(out, expected, torch.float32)
    assert torch.equal(state.conv, ref_state.conv)
    close(state.ssm, ref_state.ssm, torch.float32)


def test_conv_bias_and_gated_norm() -> None:
    """The conv's bias (Qwen3.5 has none; the interface takes one) and the output norm."""
    layer = Layer(torch.float32, seed=7)
    bias = torch.randn(SHAPE.conv_dim)
    mixed, _, _ = layer.inputs(10, seed=8)
    meta = GdnMeta.build([0, 10], [1], [False])
    expected = hf.causal_conv1d_fn(mixed.t()[None], layer.weight, bias, "silu")[0].t()
    for run in (gd.causal_conv1d, gdt.causal_conv1d_triton):
        state = SHAPE.new_state(2)
        close(run(mixed, layer.weight, bias, state.conv, meta, "silu"), expected, torch.float32)
    x, z = torch.randn(5, 24).bfloat16(), torch.randn(5, 24).bfloat16()
    norm = hf.Qwen3_5RMSNormGated(24)
    torch.nn.init.normal_(norm.weight)
    norm = norm.bfloat16()
    with torch.no_grad():
        assert torch.equal(gd.gated_rms_norm(x, z, norm.weight), norm(x, z))


# --- the C++ decode kernel (csrc/gated_delta.cpp) -----------------------------------------------

KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def decode_inputs(shape: gd.GdnShape, n: int, dtype: torch.dtype, seed: int):
    """q, k, v as views of one (n, conv_dim) conv output (strided, as the layer passes them),
    g and beta as gdn_gating gives them."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(n, shape.conv_dim, generator=gen).to(dtype)
    q, k, v = shape.split(mixed)
    a, b = torch.randn(2, n, shape.value_heads, generator=gen)
    g, beta = gd.gdn_gating(a, b, torch.rand(shape.value_heads, generator=gen).log(), a[0])
    return q, k, v, g, beta


@pytest.mark.skipif(not kernels.kernel_available(), reason="the C++ extension did not build")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "shape",
    [SHAPE, gd.GdnShape(2, 8, 128, 128), gd.GdnShape(1, 3, 48, 80)],
    ids=["dv24-gqa2", "dv128-gqa4", "dv80-gqa3"],
)
def test_decode_kernel_matches_torch_and_hf(dtype: torch.dtype, shape: gd.GdnShape) -> None:
    """The kernel's decode step (slots out of order, one request new) against the torch
    step and HF's recurrent rule per request: outputs and every slot of the pool."""
    slots, init = [4, 0, 5, 2], [1, 1, 0, 1]
    q, k, v, g, beta = decode_inputs(shape, len(slots), dtype, seed=9)
    gen = torch.Generator().manual_seed(10)
    pool = torch.randn(POOL, shape.value_heads, shape.key_dim, shape.value_dim, generator=gen)
    idx, flags = torch.tensor(slots, dtype=torch.int32), torch.tensor(init, dtype=torch.int32)
    expected_pool = pool.clone()
    expected = gd._recurrent_step(q, k, v, g, beta, expected_pool, idx, flags, True, kernel=False)
    out = torch.empty(v.shape, dtype=dtype)
    state = pool.clone()
    assert kernels.kernel_module().gated_delta_decode(
        out, q, k, v, g, beta, state, idx, flags, True
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16/fp16: one rounding of the output
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state, expected_pool, atol=1e-5, rtol=1e-5)
    for r, slot in enumerate(slots):
        h0 = pool[slot][None] if init[r] else None
        o, h = hf.torch_recurrent_gated_delta_rule(
            q[r : r + 1, None], k[r : r + 1, None], v[r : r + 1, None], g=g[r : r + 1, None],
            beta=beta[r : r + 1, None], initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[r].float(), o[0, 0].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(state[slot], h[0], atol=1e-5, rtol=1e-5)
    untouched = sorted(set(range(POOL)) - set(slots))
    assert torch.equal(state[untouched], pool[untouched])


@pytest.mark.skipif(not kernels.kernel_available(), reason="the C++ extension did not build")
def test_decode_kernel_declines_what_it_does_not_take() -> None:
    """Unsupported inputs return False with nothing written; a slot outside the pool raises."""
    q, k, v, g, beta = decode_inputs(SHAPE, 2, torch.float32, seed=11)
    state = torch.zeros(POOL, SHAPE.value_heads, SHAPE.key_dim, SHAPE.value_dim)
    out, idx = torch.zeros(v.shape), torch.tensor([1, 2], dtype=torch.int32)
    module = kernels.kernel_module()
    assert not module.gated_delta_decode(out, q, k, v, g, beta, state, idx.long(), None, True)
    assert not module.gated_delta_decode(out, q, k, v, g.double(), beta, state, idx, None, True)
    assert not module.gated_delta_decode(out, q, k, v, g, beta, state.double(), idx, None, True)
    assert not torch.any(out) and not torch.any(state)
    with pytest.raises(RuntimeError, match="outside the pool"):
        module.gated_delta_decode(out, q, k, v, g, beta, state, idx + POOL, None, True)


@pytest.mark.skipif(not kernels.kernel_available(), reason="the C++ extension did not build")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_update_kernel_matches_torch(
    dtype: torch.dtype, bias: bool, activation: str | None
) -> None:
    """The conv update kernel (slots out of order, one request new, 1100 channels: blocks and
    a tail) against the torch update: outputs within one rounding, conv states equal."""
    gen = torch.Generator().manual_seed(12)
    channels, slots, init = 1100, [4, 0, 5, 2], [1, 1, 0, 1]
    x = torch.randn(len(slots), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, 4, generator=gen).to(dtype)
    b = torch.randn(channels, generator=gen).to(dtype) if bias else None
    pool = torch.randn(POOL, channels, 3, generator=gen).to(dtype)
    idx, flags = torch.tensor(slots, dtype=torch.int32), torch.tensor(init, dtype=torch.int32)
    expected_pool, pool_ = pool.clone(), pool.clone()
    expected = gd._conv_update(x, weight, b, expected_pool, idx, flags, activation, kernel=False)
    out = torch.empty_like(x)
    module = kernels.kernel_module()
    assert module.gdn_conv_update(out, x, weight, b, pool_, idx, flags, activation == "silu")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert torch.equal(pool_, expected_pool)
