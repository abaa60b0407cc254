"""The mixture-of-experts families' decode steps in one C++ call (csrc/decoder.cpp: router,
routing, fused experts and shared expert inside `decode_layers`) against the same model run op
by op from Python (model/moe_block.py): the same bits, tokens and log-probs, for every family
that decodes there (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) and weight format, and on routers
whose experts tie at the top-k boundary. The op-by-op path is itself held to HF transformers by
test_families and test_moe."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_decode_layers
from test_decode_layers import check_one_call
from test_moe import tied_checkpoint

from families import make_family_checkpoint
from pagedllm.layers.attention import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernel_available(), reason="the CPU extension does not build here"
)

one_call = test_decode_layers.one_call  # the fixture: every step of decodes in one call

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make_family_checkpoint(root / name, name) for name in FAMILIES}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_one_call_equals_op_by_op(
    family: str, fmt: str, moe_checkpoints: dict[str, Path], one_call: list[int]
) -> None:
    check_one_call(moe_checkpoints[family], fmt, one_call, seed=1)


def test_moe_int4_one_call_equals_op_by_op(
    moe_checkpoints: dict[str, Path], one_call: list[int]
) -> None:
    check_one_call(moe_checkpoints["qwen2_moe"], "int4", one_call, seed=2)


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_tied_routers_one_call_equals_op_by_op(
    fmt: str, tmp_path: Path, one_call: list[int]
) -> None:
    """Experts tied at the top-k boundary: decode_layers breaks the ties as the op-by-op path
    (torch.topk) does, so the same tokens and log-probs."""
    check_one_call(tied_checkpoint(tmp_path), fmt, one_call, seed=3)
