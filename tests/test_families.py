"""Every dense family (tests/families.py) against HF transformers on tiny random checkpoints:
greedy tokens plain, under chunked prefill + prefix-cache hits + preemption, on two
tensor-parallel ranks, and log-probs (the only way to see the final-logit soft-cap and the
logits multiplier, which cannot change a greedy token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_logprobs_oracle import check_request
from test_quantization import assert_greedy_matches, dequantized_hf

from conftest import TINY, hf_greedy, hf_model, random_prompts
from families import FAMILIES, FEATURES_OFF, build_family_model, make_family_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.mla_config import MlaConfig
from pagedllm.moe_config import MoeConfig

MAX_NEW = 16
NAMES = list(FAMILIES)


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_family_checkpoint(root / name, name) for name in NAMES}


@pytest.fixture(scope="module")
def oracles(family_checkpoints: dict[str, Path]) -> dict[str, Any]:
    return {name: hf_model(path) for name, path in family_checkpoints.items()}


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(FEATURES_OFF))
def test_each_feature_changes_hf_output(name: str) -> None:
    """The features the tiny configs switch on change HF's own logits (else parity could not
    fail for them)."""
    ids = torch.tensor([random_prompts(1, (40, 40), TINY["vocab_size"], seed=9)[0]])
    with torch.no_grad():
        on = build_family_model(name).forward(ids, use_cache=False).logits
        off = build_family_model(name, **FEATURES_OFF[name]).forward(ids, use_cache=False).logits
    assert (on - off).abs().max() > 1e-2


@pytest.mark.parametrize("name", NAMES)
def test_config_reads_the_family(name: str, family_checkpoints: dict[str, Path]) -> None:
    """What the reader resolved from each config: the features the tiny models use."""
    cfg = ModelConfig.from_model_dir(family_checkpoints[name])
    assert cfg.architecture == FAMILIES[name][1]
    expected = {
        "qwen3": dict(qk_norm="head", head_dim=32),
        "gemma2": dict(
            norms="sandwich",
            activation="gelu_tanh",
            attn_softcap=0.6,
            final_softcap=1.2,
            layer_windows=(12, None, 12, None),
            attn_scale=20**-0.5,
            embed_scale=64**0.5,
        ),
        "gemma3": dict(qk_norm="head", layer_windows=(12, None, 12, 12), layer_ropes=(1, 0, 1, 1)),
        "phi3": dict(rotary_dim=8, layer_windows=(40, 40)),
        "olmo2": dict(qk_norm="proj", norms="post"),
        "granite": dict(embed_scale=6.0, residual_scale=0.5, attn_scale=0.4, logit_scale=2.0),
        "smollm3": dict(layer_ropes=(0, None, 0, None), layer_windows=(None,) * 4),
        "mixtral": dict(moe=MoeConfig(4, 2, 64, "softmax"), layer_moe=(True, True)),
        "qwen2_moe": dict(
            moe=MoeConfig(
                8,
                2,
                32,
                "softmax",
                norm_topk_prob=False,
                shared_intermediate_size=64,
                weights_in_model_dtype=True,
            ),
            layer_moe=(True, False),
            qkv_bias=True,
        ),
        "qwen3_moe": dict(
            moe=MoeConfig(8, 3, 32, "softmax", weights_in_model_dtype=True),
            qk_norm="head",
        ),
        "gpt_oss": dict(
            moe=MoeConfig(
                4,
                2,
                64,
                "topk_softmax",
                router_bias=True,
                expert_bias=True,
                activation="swiglu_oai",
                limit=0.5,
                oai_layout=True,
            ),
            attn_sinks=True,
            layer_windows=(12, None),
            qkv_bias=True,
            o_bias=True,
        ),
        "deepseek_v3": dict(
            mla=MlaConfig(32, 16, 8, 24, q_lora_rank=32, rope_interleave=False),
            head_dim=8,
            layer_moe=(False, True),
            softmax_scale=24**-0.5,
        ),
    }[name]
    assert {k: getattr(cfg, k) for k in expected} == expected


@pytest.mark.parametrize("name", NAMES)
def test_greedy_parity(name: str, family_checkpoints: dict[str, Path], oracles: dict) -> None:
    prompts = random_prompts(8, (1, 60), TINY["vocab_size"], seed=1)
    expected = hf_greedy(oracles[name], prompts, MAX_NEW, eos=None)
    assert len({t for row in expected for t in row}) >= 15  # not one repeated token
    llm = LLM(str(family_checkpoints[name]), enable_prefix_caching=False)
    assert greedy(llm, prompts) == expected


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefix_hits_and_preemption(
    name: str, family_checkpoints: dict[str, Path], oracles: dict
) -> None:
    """One run: prompts prefilled in 13-token chunks, a shared 24-token prefix served from the
    cache, and a pool of 24 blocks of 4 tokens, too small for the batch."""
    prefix = random_prompts(1, (24, 24), TINY["vocab_size"], seed=3)[0]
    prompts = [prefix + p for p in random_prompts(7, (1, 30), TINY["vocab_size"], seed=4)]
    llm = LLM(
        str(family_checkpoints[name]), block_size=4, num_kv_blocks=24, max_num_batched_tokens=13
    )
    assert greedy(llm, prompts) == hf_greedy(oracles[name], prompts, MAX_NEW, eos=None)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats


@pytest.mark.parametrize("name", NAMES)
def test_logprobs_within_1e4(name: str, family_checkpoints: dict[str, Path], oracles: dict) -> None:
    """Sample and prompt log-probs (top 5) against the log_softmax of HF's logits."""
    prompts = random_prompts(4, (5, 40), TINY["vocab_size"], seed=11)
    params = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=2),
    ] * 2
    llm = LLM(str(family_checkpoints[name]), block_size=4, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        check_request(oracles[name], out, p)


@pytest.mark.parametrize("name", NAMES)
def test_two_tensor_parallel_ranks(
    name: str, family_checkpoints: dict[str, Path], oracles: dict
) -> None:
    """Two ranks (q/k norms over a split projection, fused checkpoint tensors read whole and
    split, multipliers on each shard): HF's greedy tokens, with chunked prefill."""
    prompts = random_prompts(5, (3, 40), TINY["vocab_size"], seed=6)
    expected = hf_greedy(oracles[name], prompts, 10, eos=None)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(
        str(family_checkpoints[name]),
        device="cpu",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        block_size=4,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", NAMES)
def test_weight_quantization(name: str, method: str, family_checkpoints: dict[str, Path]) -> None:
    """Weights quantized at load: HF's greedy tokens on the same dequantized weights (with the
    activations rounded as the kernels round them), under chunked prefill."""
    path = family_checkpoints[name]
    prompts = random_prompts(6, (3, 40), TINY["vocab_size"], seed=12)
    model = dequantized_hf(path, method)
    expected = hf_greedy(model, prompts, 10, eos=None)
    llm = LLM(str(path), quantization=method, max_num_batched_tokens=16, max_model_len=128)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert_greedy_matches(model, prompts, [o.outputs[0].token_ids for o in outs], expected)
