"""The decoder layers of a decode step in one C++ call (csrc/decoder.cpp) against the same
model run op by op from Python: the same kernels in the same order, so the same bits — tokens
and log-probs — for every architecture (q/k/v bias, GQA, sliding window) and weight format,
and every feature a family turns on (q/k norms, norms after the blocks, GeLU, soft-cap,
softmax scale, per-layer windows and ropes, NoPE; a mixture of experts' routing, ties
included, fused experts and shared expert; DeepSeek-V3's latent attention and grouped sigmoid
router). The op-by-op path is itself held to HF transformers by test_parity,
test_quantization and test_mla."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_mla import VARIANTS as MLA_VARIANTS
from test_mla import make_checkpoint as mla_checkpoint
from test_moe import tied_checkpoint

from conftest import random_prompts
from families import DENSE, MOE, build_family_model, make_family_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig, RopeConfig
from pagedllm.layers import quant
from pagedllm.layers.attention import StepInputs, cpu_kernels
from pagedllm.layers.attention.cpu_backend import CpuAttentionBackend
from pagedllm.lora.ops import LoraStep
from pagedllm.model import decoder_kernel
from pagedllm.model.decoder import CausalLM, ForwardContext
from pagedllm.model.rope import rotary_table

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernel_available(), reason="the CPU extension does not build here"
)

FORMATS = {  # name -> LLM keyword arguments
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
}


def _generate(
    llm: LLM, prompts: list[list[int]], lora_request: Any = None
) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    inputs: Any = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_request)
    result = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        result.append(
            (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        )
    return result


@pytest.fixture
def one_call(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The kernels for every row count; the row counts of the decode_layers calls, listed."""
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS))
    module = cpu_kernels.kernel_module()
    calls: list[int] = []
    real = module.decode_layers

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(module, "decode_layers", counted)
    yield calls


def check_one_call(path: Path, fmt: str, calls: list[int], seed: int) -> None:
    """Greedy tokens and log-probs of the checkpoint at `path`, decodes through decode_layers,
    then op by op: the same."""
    llm = LLM(
        str(path),
        max_num_seqs=4,
        max_model_len=128,
        enable_prefix_caching=False,  # the second run computes what the first did
        **FORMATS[fmt],
    )
    model = llm.engine.runner.model
    assert model._kernel_weights, "the one-call path is not set up"
    # mixed lengths: decodes of 1-4 requests, some past the windows (mistral's 24, 12 in
    # tests/families.py)
    prompts = random_prompts(4, (3, 40), model.config.vocab_size, seed=seed)
    calls.clear()
    fused = _generate(llm, prompts)
    assert calls and max(calls) > 1, "no step of several decodes went through decode_layers"
    model._kernel_weights = []
    calls.clear()
    op_by_op = _generate(llm, prompts)
    assert not calls
    assert fused == op_by_op


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_one_call_equals_op_by_op(
    arch: str, fmt: str, checkpoints: dict[str, Path], one_call: list[int]
) -> None:
    check_one_call(checkpoints[arch], fmt, one_call, seed=list(FORMATS).index(fmt))


# every family: the mixtures of experts with their router, routing, fused experts and shared
# expert in the one call too, DeepSeek-V3's latent attention and grouped router
ONE_CALL = DENSE + MOE


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_family_checkpoint(root / name, name) for name in ONE_CALL}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("family", ONE_CALL)
def test_family_one_call_equals_op_by_op(
    family: str, fmt: str, family_checkpoints: dict[str, Path], one_call: list[int]
) -> None:
    check_one_call(family_checkpoints[family], fmt, one_call, seed=0)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_moe_int4_one_call_equals_op_by_op(
    family: str, family_checkpoints: dict[str, Path], one_call: list[int]
) -> None:
    """int4 experts (and a gated shared expert; DeepSeek's latent projections) in the one
    call."""
    check_one_call(family_checkpoints[family], "int4", one_call, seed=2)


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_tied_routers_one_call_equals_op_by_op(
    fmt: str, tmp_path: Path, one_call: list[int]
) -> None:
    """Experts tied at the top-k boundary in every layer: decode_layers breaks the ties as the
    op-by-op path (torch.topk, as HF) does, so the same tokens and log-probs."""
    check_one_call(tied_checkpoint(tmp_path), fmt, one_call, seed=3)


def deepseek_tied_checkpoint(path: Path) -> Path:
    """A random DeepSeek-V3 whose experts 1-3 (of group 0-3) share a router row and a score
    correction bias in every MoE layer, the row scaled up: when group 0 wins, three experts
    tie for its two places. The other biases random (transformers' init is zeros)."""
    model = build_family_model("deepseek_v3")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers[1:]:  # the first layer dense
            gate = layer.mlp.gate
            gate.weight[1:4] = gate.weight[0] * 4
            bias = gate.e_score_correction_bias
            bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
            bias[1:4] = bias[1]
    model.save_pretrained(path)
    make_family_checkpoint(path / "tok", "deepseek_v3")  # its tokenizer files
    for f in (path / "tok").glob("tok*"):
        f.rename(path / f.name)
    return path


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_deepseek_tied_router_one_call_equals_op_by_op(
    fmt: str, tmp_path: Path, one_call: list[int]
) -> None:
    """DeepSeek's grouped sigmoid router with experts tied at the top-k boundary: the one call
    breaks the ties as the op-by-op path (torch.topk, as HF) does."""
    check_one_call(deepseek_tied_checkpoint(tmp_path), fmt, one_call, seed=4)


@pytest.mark.parametrize("variant", ["q_proj", "yarn_half_split"])
def test_latent_attention_variants_one_call_equals_op_by_op(
    variant: str, tmp_path: Path, one_call: list[int]
) -> None:
    """test_mla's latent attention without q_lora (q_proj straight from the hidden state,
    biases on kv_a_proj_with_mqa and o_proj), and with yarn's mscale in the softmax scale."""
    path = mla_checkpoint(tmp_path, **MLA_VARIANTS[variant])
    check_one_call(path, "bf16", one_call, seed=5)


def test_steps_with_a_prefill_run_op_by_op(checkpoints: dict[str, Path]) -> None:
    """A step that holds a prefill chunk is not all decodes: the backend says so."""
    llm = LLM(str(checkpoints["llama"]), max_num_seqs=2, max_model_len=128)
    runner = llm.engine.runner
    seen: list[bool] = []
    real = runner.backend.decode_batch

    def spy(metadata: Any) -> Any:
        out = real(metadata)
        seen.append(out is not None)
        return out

    runner.backend.decode_batch = spy  # type: ignore[method-assign]
    _generate(llm, [[5, 6, 7]])
    assert seen[0] is False and all(seen[1:]) and len(seen) == 20


# ---- each family feature on a tiny model built from a ModelConfig (random weights)

# feature -> (config fields that switch it on, fields that switch it off, LayerWeights fields
# that switch it off where the config cannot: the model's norm modules stay)
FEATURES: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]] = {
    "qk_norm_head": ({"qk_norm": "head"}, {"qk_norm": None}, ()),
    "qk_norm_proj": ({"qk_norm": "proj"}, {"qk_norm": None}, ()),
    "sandwich_norms": ({"norms": "sandwich"}, {}, ("post1", "post2")),
    "post_norms": ({"norms": "post"}, {}, ("post1", "post2")),
    "gelu_tanh": ({"activation": "gelu_tanh"}, {"activation": "silu"}, ()),
    "gelu": ({"activation": "gelu"}, {"activation": "silu"}, ()),
    # a scale that makes the scores a few units wide, so that a cap of 2 bites
    "softcap": ({"attn_softcap": 2.0, "attn_scale": 1.0}, {"attn_softcap": None}, ()),
    "softmax_scale": ({"attn_scale": 0.3}, {"attn_scale": None}, ()),
    "layer_windows": ({"layer_windows": (4, None)}, {"layer_windows": (None, None)}, ()),
    "local_rope": (
        {"ropes": (RopeConfig(), RopeConfig(theta=100.0)), "layer_ropes": (0, 1)},
        {"layer_ropes": (0, 0)},
        (),
    ),
    "nope": ({"layer_ropes": (None, 0)}, {"layer_ropes": (0, 0)}, ()),
    # all of Gemma 3's at once, and OLMo 2's
    "gemma3_like": (
        {
            "qk_norm": "head",
            "norms": "sandwich",
            "activation": "gelu_tanh",
            "attn_softcap": 2.0,
            "attn_scale": 1.0,
            "layer_windows": (4, None),
            "ropes": (RopeConfig(), RopeConfig(theta=100.0)),
            "layer_ropes": (1, 0),
        },
        {"attn_softcap": None, "layer_windows": (None, None)},
        (),
    ),
    "olmo2_like": ({"qk_norm": "proj", "norms": "post"}, {"qk_norm": None}, ()),
}


def tiny_config(**features: Any) -> ModelConfig:
    """A two-layer Llama, with `features` (ModelConfig fields) on."""
    base: dict[str, Any] = dict(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        ropes=(RopeConfig(),),
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        layer_windows=(None, None),
        layer_ropes=(0, 0),
        checkpoint_dtype=None,
    )
    return ModelConfig(**{**base, **features})


def tiny_model(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """Random weights: the linears keep nn.Linear's init (scores of a few units), norms near 1."""
    torch.manual_seed(0)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape))
            elif "embed" in name:
                param.normal_()
    model.to(dtype)
    model.finalize_weights()
    return model


def switch_off(model: CausalLM, fields: dict[str, Any], weights: tuple[str, ...]) -> None:
    model.config = dataclasses.replace(model.config, **fields)
    model.finalize_weights()
    if weights:
        model.layer_weights = [w._replace(**dict.fromkeys(weights)) for w in model.layer_weights]
        model._kernel_weights, model._kernel_rows = decoder_kernel.flatten(model)


@torch.inference_mode()
def decode_steps(
    model: CausalLM, steps: int = 3, lora: LoraStep | None = None
) -> list[torch.Tensor]:
    """The logits of `steps` decode steps of three requests over random cached contexts (3, 9
    and 17 tokens: some past the window of 4, several blocks of 4), then the KV caches; `lora`:
    the three tokens' adapters (tests/test_lora_one_call.py)."""
    cfg, dtype = model.config, model.norm.weight.dtype
    gen = torch.Generator().manual_seed(0)
    lens, block_size, per_request = [3, 9, 17], 4, 6
    tables = torch.randperm(3 * per_request + 1, generator=gen)[: 3 * per_request].view(3, -1)
    backend = CpuAttentionBackend()
    shape = backend.kv_cache_shape(3 * per_request + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(cfg.num_layers)]
    rotary = [
        rotary_table(rope, cfg.head_dim, cfg.max_position_embeddings, 64) for rope in cfg.ropes
    ]
    logits = []
    for s in range(steps):
        context_lens = [n + s + 1 for n in lens]  # the new token included
        positions = torch.tensor(context_lens) - 1
        slots = tables[torch.arange(3), positions // block_size] * block_size
        step = StepInputs(
            input_ids=torch.randint(2, cfg.vocab_size, (3,), generator=gen),
            positions=positions,
            slot_mapping=slots + positions % block_size,
            query_start_loc=[0, 1, 2, 3],
            context_lens=context_lens,
            block_tables=tables,
            num_decodes=3,
            logits_indices=torch.arange(3),
            block_size=block_size,
        )
        rotations = tuple(table[positions].unsqueeze(1) for table in rotary)
        ctx = ForwardContext(rotations, caches, backend, backend.build_metadata(step), lora)
        logits.append(model(step.input_ids, ctx, step.logits_indices))
    return logits + caches


def fused_and_op_by_op(model: CausalLM, calls: list[int]) -> tuple[list[torch.Tensor], ...]:
    calls.clear()
    fused = decode_steps(model)
    assert calls == [3, 3, 3], "the steps did not go through decode_layers"
    kernel_weights, model._kernel_weights = model._kernel_weights, []
    op_by_op = decode_steps(model)
    model._kernel_weights = kernel_weights
    assert calls == [3, 3, 3]
    return fused, op_by_op


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_one_call_equals_op_by_op(
    feature: str, dtype: torch.dtype, one_call: list[int]
) -> None:
    on, off, weights_off = FEATURES[feature]
    model = tiny_model(tiny_config(**on), dtype)
    fused, op_by_op = fused_and_op_by_op(model, one_call)
    assert same_bits(fused, op_by_op)
    # the feature matters: without it the same weights give other logits (a kernel that
    # ignored it would not match the op-by-op path)
    switch_off(model, off, weights_off)
    fused_off, op_by_op_off = fused_and_op_by_op(model, one_call)
    assert same_bits(fused_off, op_by_op_off)
    assert not same_bits(fused_off[:3], fused[:3]), f"{feature} changes nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sinks_one_call_equals_op_by_op(dtype: torch.dtype, one_call: list[int]) -> None:
    """gpt-oss's attention sinks (each layer's own, a windowed and a global layer) reach the
    fused step's attention: the same bits as op by op, other logits than without them."""
    model = tiny_model(tiny_config(layer_windows=(4, None)), dtype)
    without, _ = fused_and_op_by_op(model, one_call)
    gen = torch.Generator().manual_seed(1)
    heads = model.config.num_heads
    model.layer_weights = [
        w._replace(attn=w.attn._replace(sinks=torch.randn(heads, generator=gen) * 2 + 2))
        for w in model.layer_weights
    ]
    model._kernel_weights, model._kernel_rows = decoder_kernel.flatten(model)
    assert model._kernel_weights, "the one-call path refused the sinks"
    fused, op_by_op = fused_and_op_by_op(model, one_call)
    assert same_bits(fused, op_by_op)
    assert not same_bits(fused[:3], without[:3]), "the sinks change nothing"
