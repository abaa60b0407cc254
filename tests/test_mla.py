"""Multi-head latent attention (DeepSeek-V3; model/mla.py) against transformers on tiny random
checkpoints whose layers are all dense: greedy tokens (queries through q_lora or a plain q_proj,
interleaved or half-split rope rows, yarn's softmax mscale, biases), under chunked prefill +
prefix hits + preemption, on two tensor-parallel ranks, quantized, log-probs within 1e-4; the
absorbed decode equal to the expanded one; the cache's bytes per token as the engine reports
them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_logprobs_oracle import check_request
from test_quantization import assert_greedy_matches, dequantized_hf

from conftest import TINY, build_tokenizer, hf_greedy, hf_model, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.mla_config import MlaConfig
from pagedllm.model.mla import MlaWeights, attend_expanded, decode_absorbed

MAX_NEW = 12
# MLA's sizes; every layer dense (first_k_dense_replace = num_hidden_layers)
MLA = dict(
    num_key_value_heads=TINY["num_attention_heads"],
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    first_k_dense_replace=TINY["num_hidden_layers"],
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=128,
    mscale=1.0,
    mscale_all_dim=0.707,
    rope_theta=10000.0,
)
VARIANTS: dict[str, dict[str, Any]] = {
    "q_lora": {},
    # DeepSeek-V2-Lite's plain q_proj; biases on kv_a_proj_with_mqa and o_proj
    "q_proj": dict(q_lora_rank=None, attention_bias=True),
    # half-split rope rows (permuted at load), yarn's mscale in the softmax scale
    "yarn_half_split": dict(rope_interleave=False, rope_parameters=YARN),
}


@torch.no_grad()
def build_model(seed: int = 0, **overrides: Any) -> Any:
    import transformers

    cfg = transformers.DeepseekV3Config(**{**TINY, **MLA, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    for name, p in model.named_parameters():  # norms and biases away from their init
        if name.endswith(("norm.weight", "bias")):
            p.add_((0.3 if name.endswith("weight") else 0.02) * torch.randn_like(p))
    return model


def make_checkpoint(path: Path, **overrides: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    build_model(**overrides).save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla")
    return {name: make_checkpoint(root / name, **o) for name, o in VARIANTS.items()}


@pytest.fixture(scope="module")
def oracles(checkpoints: dict[str, Path]) -> dict[str, Any]:
    return {name: hf_model(path) for name, path in checkpoints.items()}


def greedy(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


def test_config(checkpoints: dict[str, Path]) -> None:
    """The latent sizes, head_dim as transformers sets it (the rotated dims) and the softmax
    scale: qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared."""
    cfg = ModelConfig.from_model_dir(checkpoints["q_lora"])
    assert cfg.mla == MlaConfig(32, 16, 8, 24, q_lora_rank=32)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.softmax_scale) == (8, 8, 24**-0.5)
    assert cfg.layer_moe == (False, False)
    yarn = ModelConfig.from_model_dir(checkpoints["yarn_half_split"])
    assert yarn.mla is not None and not yarn.mla.rope_interleave
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert yarn.softmax_scale == pytest.approx(24**-0.5 * mscale**2)
    q_proj = ModelConfig.from_model_dir(checkpoints["q_proj"])
    assert q_proj.mla is not None and q_proj.mla.q_lora_rank is None
    hf = build_model(**VARIANTS["q_proj"])
    assert q_proj.num_parameters == sum(p.numel() for p in hf.parameters())


def test_variants_change_hf_output() -> None:
    """Half-split rope rows and yarn's mscale change HF's logits (else parity could not fail
    for them)."""
    ids = torch.tensor([random_prompts(1, (40, 40), TINY["vocab_size"], seed=9)[0]])
    with torch.no_grad():
        base = build_model().forward(ids, use_cache=False).logits
        half = build_model(rope_interleave=False).forward(ids, use_cache=False).logits
        yarn = build_model(rope_parameters=YARN).forward(ids, use_cache=False).logits
    assert (base - half).abs().max() > 1e-2 and (base - yarn).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_parity(name: str, checkpoints: dict[str, Path], oracles: dict) -> None:
    prompts = random_prompts(6, (1, 60), TINY["vocab_size"], seed=1)
    expected = hf_greedy(oracles[name], prompts, MAX_NEW, eos=None)
    assert len({t for row in expected for t in row}) >= 15  # not one repeated token
    llm = LLM(str(checkpoints[name]), enable_prefix_caching=False)
    assert greedy(llm, prompts) == expected


def test_chunked_prefix_hits_and_preemption(checkpoints: dict[str, Path], oracles: dict) -> None:
    """Chunks of 13 tokens attend to their cached latent prefix, a shared 24-token prefix is
    served from the cache, a pool of 24 blocks of 4 tokens is too small for the batch."""
    prefix = random_prompts(1, (24, 24), TINY["vocab_size"], seed=3)[0]
    prompts = [prefix + p for p in random_prompts(7, (1, 30), TINY["vocab_size"], seed=4)]
    llm = LLM(
        str(checkpoints["yarn_half_split"]),
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=13,
    )
    expected = hf_greedy(oracles["yarn_half_split"], prompts, MAX_NEW, eos=None)
    assert greedy(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert stats.kv_blocks_used == 0


def test_logprobs_within_1e4(checkpoints: dict[str, Path], oracles: dict) -> None:
    prompts = random_prompts(4, (5, 40), TINY["vocab_size"], seed=11)
    params = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=2),
    ] * 2
    llm = LLM(str(checkpoints["q_lora"]), block_size=4, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        check_request(oracles["q_lora"], out, p)


@pytest.mark.parametrize("name", ["q_lora", "q_proj"])
def test_two_tensor_parallel_ranks(name: str, checkpoints: dict[str, Path], oracles: dict) -> None:
    """Heads split over two ranks (q_b_proj / q_proj and kv_b_proj rows, o_proj columns), the
    latent projection replicated: HF's greedy tokens, with chunked prefill."""
    prompts = random_prompts(4, (3, 40), TINY["vocab_size"], seed=6)
    expected = hf_greedy(oracles[name], prompts, 8, eos=None)
    with LLM(
        str(checkpoints[name]),
        device="cpu",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        block_size=4,
    ) as llm:
        assert greedy(llm, prompts, 8) == expected


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_weight_quantization(method: str, checkpoints: dict[str, Path]) -> None:
    """q_a/q_b, kv_a_proj_with_mqa and o_proj quantized at load (kv_b_proj dense): HF's greedy
    tokens on the same dequantized weights, under chunked prefill."""
    path = checkpoints["q_lora"]
    prompts = random_prompts(6, (3, 40), TINY["vocab_size"], seed=12)
    model = dequantized_hf(path, method)
    expected = hf_greedy(model, prompts, 10, eos=None)
    llm = LLM(str(path), quantization=method, max_num_batched_tokens=16, max_model_len=128)
    assert sorted(n.split(".")[-2] for n in llm.engine.runner.model.quantized if ".0." in n) == [
        "down_proj",
        "gate_up_proj",
        "kv_a_proj_with_mqa",
        "o_proj",
        "q_a_proj",
        "q_b_proj",
    ]
    assert_greedy_matches(model, prompts, greedy(llm, prompts, 10), expected)


def test_kv_bytes_per_token(checkpoints: dict[str, Path]) -> None:
    """The cache holds per token and layer the latent and the rotated key, one row for all
    heads: (32 + 8) values, against 4 heads * (24 + 24) for per-head keys and values."""
    llm = LLM(str(checkpoints["q_lora"]), kv_cache_memory=1 << 20, max_model_len=256)
    layers, fp32 = TINY["num_hidden_layers"], 4
    assert llm.engine.stats().kv_bytes_per_token == layers * (32 + 8) * fp32
    cache = llm.engine.runner.kv_caches[0]
    assert cache.shape[1:] == (16, 40)
    per_head = layers * 4 * (16 + 8 + 24) * fp32
    assert per_head == 4.8 * llm.engine.stats().kv_bytes_per_token
    # the budget sizes the pool by the latent rows: 1 MiB of them
    assert cache.shape[0] == (1 << 20) // (layers * 16 * 40 * fp32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_decode_equals_expanded(dtype: torch.dtype) -> None:
    """The decode path (W_uk folded into the query, attention over the cached latents, W_uv
    after) equals attention over the context expanded per head, with ragged contexts."""
    torch.manual_seed(0)
    heads, nope, rope, v, rank, d, t = 4, 16, 8, 24, 32, 3, 37
    kv_b = torch.randn(heads, nope + v, rank) / rank**0.5
    w = MlaWeights(None, None, None, None, None, None, None, kv_b[:, :nope], kv_b[:, nope:])  # type: ignore[arg-type]
    w = w._replace(w_uk=w.w_uk.to(dtype), w_uv=w.w_uv.to(dtype))
    q_nope, q_rope = (
        torch.randn(d, heads, nope, dtype=dtype),
        torch.randn(d, heads, rope, dtype=dtype),
    )
    ctx = torch.randn(d, t, rank + rope, dtype=dtype)
    lens = torch.tensor([37, 5, 20])
    mask = (torch.arange(t) < lens[:, None])[:, None, None, :]
    absorbed = decode_absorbed(q_nope, q_rope, ctx, mask, w, 0.1)
    for i in range(d):
        n = int(lens[i])
        row = torch.ones(1, n, dtype=torch.bool)
        expanded = attend_expanded(q_nope[i : i + 1], q_rope[i : i + 1], ctx[i, :n], row, w, 0.1)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(absorbed[i : i + 1], expanded, atol=tol, rtol=tol)
