"""The fused-MoE Triton kernels (layers/moe_triton.py) against the per-expert loop
(`experts_loop`): under the Triton interpreter on CPU tensors (compiled on a CUDA device), every
activation, with and without biases, fp32 / fp16 / bf16, 1 to 40 tokens, k = 1 / 2 / 4, experts
that get no token, 16-wide tiles so the tiny shapes cross several M, N and K tiles (H = 48: whole
K tiles; I = 40: a partial N tile and K tile). On a GPU (`gpu`): the claimed shapes of
layers/moe_workloads.py, the launches the compile check records, with random values.

Tolerances (outputs ~1, atol = rtol): fp32 1e-5; fp16 3e-3 and bf16 2e-2, a few units of the
last place (the loop rounds each linear's output to the dtype before the activation and the
routing weight; the kernels round once, the intermediate `h`): the worst errors measured are
5 %, 30 % and 40 % of these. On a GPU, over K up to 14336, fp16 1e-2 and bf16 5e-2 (not yet
measured on hardware).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.layers.moe import ACTIVATIONS, Experts, experts_loop
from pagedllm.layers.moe_workloads import MoeShape, make_experts

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="the triton package is missing: pip install -e '.[dev]'",
)

# (atol, rtol)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
GPU_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}
DTYPES = list(TOL)


@pytest.fixture(scope="module")
def device() -> str:
    """CUDA when present, else the CPU under the interpreter (conftest.py sets it)."""
    from pagedllm.layers import moe_triton

    if torch.cuda.is_available():
        return "cuda"
    assert moe_triton.INTERPRETED
    return "cpu"


def routed(
    n: int, k: int, experts: int, used: int, device: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids): k distinct experts per token among the first `used` only
    (the others get no token)."""
    ids = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=gen), dim=-1)
    return weights.to(device), ids.to(device)


def check(
    n: int,
    k: int,
    dtype: torch.dtype,
    device: str,
    activation: str = "silu",
    bias: bool = False,
    limit: float = 7.0,
    small_tiles: bool = True,
) -> None:
    from pagedllm.layers.moe_triton import MoeLaunch, fused_experts_triton

    gen = torch.Generator().manual_seed(n * 100 + k)
    shape = MoeShape("tiny", 48, 40, 6, k, bias, activation)
    experts = make_experts(shape, dtype, "cpu", gen)
    experts = Experts(
        *(None if t is None else t.to(device) for t in (experts.w13, experts.w2, experts.b13)),
        None if experts.b2 is None else experts.b2.to(device),
        activation,
        limit,
    )
    x = torch.randn(n, shape.hidden, generator=gen).to(dtype).to(device)
    weights, ids = routed(n, k, shape.experts, shape.experts - 2, device, gen)
    launch = MoeLaunch(16, 16, 16, num_warps=4, num_stages=2) if small_tiles else None
    out = fused_experts_triton(x, weights, ids, experts, launch)
    assert out is not None and out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, experts_loop(x, weights, ids, experts), atol=atol, rtol=rtol)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_activation_and_dtype(
    device: str, dtype: torch.dtype, activation: str, bias: bool
) -> None:
    # limit 1: swiglu_oai's clamps bite on values ~1
    check(7, 2, dtype, device, activation, bias, limit=1.0)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 7, 40])
def test_token_counts_and_top_k(device: str, n: int, k: int) -> None:
    check(n, k, torch.float16, device, "swiglu_oai", bias=True, limit=1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_launch_table(device: str, dtype: torch.dtype) -> None:
    """The tiles `moe_launch` picks (64 wide: one partial N and K tile here)."""
    check(40, 4, dtype, device, small_tiles=False)


def test_the_pairs_are_grouped_by_expert_and_padded() -> None:
    from pagedllm.layers.moe_triton import align_pairs

    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [3, 1]])  # experts 2 and 4: no token
    sorted_ids, expert_ids, num_padded = align_pairs(ids, 6, 2)
    sentinel = ids.numel()
    # expert 0: pairs 1, 4; 1: 7 + pad; 3: 0, 2, 5, 6; 5: 3 + pad; then unused blocks
    want = [1, 4, 7, sentinel, 0, 2, 5, 6, 3, sentinel]
    assert sorted_ids[: len(want)].tolist() == want
    assert (sorted_ids[len(want) :] == sentinel).all()
    assert num_padded.tolist() == [10]
    assert expert_ids.tolist()[:5] == [0, 1, 3, 3, 5]
    # the grid bound: min(pairs, cdiv(pairs, block_m) + experts) blocks, the rest past the end
    assert len(expert_ids) == 8 and (expert_ids[5:] == 6).all()
    assert len(sorted_ids) == 8 * 2


def test_launch_tiles_follow_the_tokens_per_expert() -> None:
    from pagedllm.layers.moe_triton import moe_launch

    assert moe_launch(64 * 2, 8, torch.bfloat16).block_m == 16  # Mixtral, 64 decodes
    assert moe_launch(512 * 8, 128, torch.bfloat16).block_m == 32  # Qwen3-30B-A3B prefill
    assert moe_launch(512 * 2, 8, torch.float16).block_m == 64  # Mixtral prefill
    assert moe_launch(512 * 2, 8, torch.float32).num_warps == 8


def test_quantized_experts_are_not_supported() -> None:
    from pagedllm.layers.moe_triton import fused_experts_triton
    from pagedllm.layers.quant import QuantizedWeight

    q = QuantizedWeight(4, torch.zeros(2, 8, 2, dtype=torch.uint8), torch.ones(2, 8, 1), None)
    experts = Experts(q, q)
    x, ids = torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.long)
    assert fused_experts_triton(x, torch.ones(1, 1), ids, experts) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_claimed_shapes_match_the_loop_on_a_gpu() -> None:
    from pagedllm.layers.moe_workloads import MOE_DTYPES, MOE_SHAPES, moe_cases, run_moe_case

    gen = torch.Generator("cuda").manual_seed(0)
    failures = []
    for shape in MOE_SHAPES:
        for dtype in MOE_DTYPES.values():
            for case in moe_cases(shape, dtype, "cuda", gen):
                out = run_moe_case(case)
                want = experts_loop(case.x, case.topk_weights, case.topk_ids, case.experts)
                error = (out.float() - want.float()).abs().max().item()
                atol, rtol = GPU_TOL[dtype]
                if error > atol + rtol * want.float().abs().max().item():
                    failures.append(f"{case.label}: max error {error:.2e}")
    assert not failures, failures
