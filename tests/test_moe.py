"""Mixtures of experts beyond the family parity tests (tests/test_families.py): routing as
transformers routes (its dtypes, its tie-breaking), the experts stacked in one checkpoint
tensor, and the per-expert loop against the fused kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY, hf_greedy, hf_model, random_prompts
from families import FAMILIES, build_family_model, family_config, make_family_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.model.moe_block import route


def _routers() -> list[tuple[str, torch.nn.Module]]:
    import transformers.models.gpt_oss.modeling_gpt_oss as oss
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers.models.qwen2_moe.modeling_qwen2_moe as qwen2
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3

    return [
        ("mixtral", mixtral.MixtralTopKRouter(family_config("mixtral"))),
        ("qwen3_moe", qwen3.Qwen3MoeTopKRouter(family_config("qwen3_moe"))),
        ("qwen2_moe", qwen2.Qwen2MoeTopKRouter(family_config("qwen2_moe"))),
        ("gpt_oss", oss.GptOssTopKRouter(family_config("gpt_oss"))),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, router", _routers(), ids=lambda v: v if isinstance(v, str) else "")
def test_routing_is_transformers_routing(
    name: str, router: torch.nn.Module, dtype: torch.dtype
) -> None:
    """Same experts and weights as HF's router, ties included: three experts share one router
    row, so tokens routed to them tie at the top-k boundary (torch.topk breaks the tie)."""
    arch = FAMILIES[name][1]
    cfg = ModelConfig.from_hf(family_config(name).to_dict() | {"architectures": [arch]})
    assert cfg.moe is not None
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.weight[1:3] = router.weight[0]
        if getattr(router, "bias", None) is not None:
            router.bias.zero_()
    router.to(dtype)
    x = torch.randn(64, cfg.hidden_size, dtype=dtype)
    with torch.no_grad():
        _, want_w, want_ids = router(x)
        logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
    weights, ids = route(logits, cfg.moe)
    tied = (want_ids < 3).sum(-1) >= 1
    assert tied.sum() >= 8  # the tie is exercised
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w.float(), rtol=0, atol=0)


def tied_checkpoint(path: Path) -> Path:
    """A random Qwen3-MoE whose experts 0-2 share a router row in every layer (scaled up:
    often the top experts, always tied), saved with its tokenizer at `path`."""
    model = build_family_model("qwen3_moe")
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w[1:3] = w[0] * 4
    model.save_pretrained(path)
    make_family_checkpoint(path / "tok", "qwen3_moe")  # its tokenizer files
    for f in (path / "tok").glob("tok*"):
        f.rename(path / f.name)
    return path


def test_ties_in_a_whole_model_route_as_hf(tmp_path: Path) -> None:
    """A Qwen3-MoE whose experts 0-2 share a router row in every layer: HF's greedy tokens
    (its decode steps in one C++ call, csrc/decoder.cpp, where the extension builds;
    test_decode_layers holds that path to the op-by-op one on the same model)."""
    path = tied_checkpoint(tmp_path)
    prompts = random_prompts(6, (2, 40), TINY["vocab_size"], seed=21)
    expected = hf_greedy(hf_model(path), prompts, 12, eos=None)
    llm = LLM(str(path), max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_experts_stacked_in_the_checkpoint(tmp_path: Path) -> None:
    """transformers' in-memory layout (every expert in one (E, 2I, H) / (E, H, I) tensor)
    loads to the same model as one tensor per expert (the Hub's layout)."""
    per_expert = make_family_checkpoint(tmp_path / "per_expert", "mixtral")
    tensors = load_file(per_expert / "model.safetensors")
    cfg = ModelConfig.from_model_dir(per_expert)
    assert cfg.moe is not None
    stacked: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            stacked[name] = t
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.block_sparse_moe.experts"
        e = range(cfg.moe.num_experts)
        stacked[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}.{j}.w1.weight"], tensors[f"{p}.{j}.w3.weight"]]) for j in e]
        )
        stacked[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"{p}.{j}.w2.weight"] for j in e]
        )
    other = tmp_path / "stacked"
    other.mkdir()
    for f in per_expert.iterdir():
        if f.name != "model.safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    save_file(stacked, other / "model.safetensors")
    prompts = random_prompts(4, (3, 30), TINY["vocab_size"], seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    got = [
        LLM(str(d)).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for d in (per_expert, other)
    ]
    for a, b in zip(*got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def _deepseek_config(**overrides: object) -> object:
    import transformers

    fields = dict(
        TINY,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=32,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=0,
    )
    return transformers.DeepseekV3Config(**{**fields, **overrides})


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_block_is_transformers_block(norm: bool) -> None:
    """DeepSeek-V3's MoE block (sigmoid scores, a correction bias that only chooses, the best 2
    of 4 groups, routed scaling, two shared experts without a gate) against transformers'
    DeepseekV3MoE on the same weights, ties included (experts 0-2 share a router row)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from pagedllm.layers.moe import Experts
    from pagedllm.model.moe_block import MoeWeights, SharedExpert, moe_forward
    from pagedllm.moe_config import from_hf

    hf_cfg = _deepseek_config(norm_topk_prob=norm)
    moe, sparse = from_hf(hf_cfg.to_dict(), "deepseek", 2, "silu")  # type: ignore[attr-defined]
    assert sparse == (True, True) and moe.shared_intermediate_size == 64
    torch.manual_seed(0)
    block = DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        block.gate.weight[1:3] = block.gate.weight[0]
        block.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.05)
    x = torch.randn(40, TINY["hidden_size"])
    with torch.no_grad():
        want = block(x[None])[0]
        _, want_w, want_ids = block.gate(x)
    shared = block.shared_experts
    weights = MoeWeights(
        block.gate.weight,
        None,
        Experts(block.experts.gate_up_proj.data, block.experts.down_proj.data),
        SharedExpert(
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight]),
            shared.down_proj.weight,
            None,
        ),
        block.gate.e_score_correction_bias,
    )
    from pagedllm.model.moe_block import route

    got_w, got_ids = route(
        torch.nn.functional.linear(x, block.gate.weight), moe, weights.score_bias
    )
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
    with torch.no_grad():
        got = moe_forward(x, weights, moe, "silu", None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
