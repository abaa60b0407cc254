"""Rotary tables against transformers' own: its rotary embedding modules (LlamaRotaryEmbedding,
Phi3RotaryEmbedding, ...) built from a config object, for every rope type we serve, at
positions within and past the original context; the rotation of q in our interleaved layout
against `apply_rotary_pos_emb` (rotate_half) in theirs; the rope fields read from both config
spellings; and a tiny Phi-3 with longrope decoding past its original context."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY, hf_greedy, hf_model, random_prompts
from families import make_family_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, ModelConfig, RopeConfig
from pagedllm.layers.attention import cpu_kernels
from pagedllm.model.rope import attention_factor, interleave_rows, rope_cos_sin, rotary_table

HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]  # 16
ORIGINAL, MAX_POS, NUM_POS = 64, 256, 1024
# around the original context, max_position_embeddings and well past both
POSITIONS = (0, 1, 17, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 200, MAX_POS - 1, MAX_POS, 1000)


def factors(n: int, low: float, high: float) -> list[float]:
    return torch.linspace(low, high, n).tolist()


def longrope(dim: int, **extra: Any) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "short_factor": factors(dim // 2, 1.0, 1.5),
        "long_factor": factors(dim // 2, 1.0, 12.0),
        **extra,
    }


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}

# name -> (transformers model prefix, config overrides of TINY)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("Llama", {}),
    "linear": ("Llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0}}),
    "dynamic": ("Llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama3": (
        "Llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
            }
        },
    ),
    "yarn": ("Llama", {"rope_parameters": YARN}),
    "yarn-qwen3": ("Qwen3", {"head_dim": HEAD_DIM, "rope_parameters": {**YARN, "rope_theta": 1e6}}),
    "yarn-mscale": ("Llama", {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    "yarn-attention-factor": (
        "Llama",
        {
            "rope_parameters": {
                **YARN,
                "rope_theta": 100.0,  # with these betas a ramp from dim 1.6 to 5.2
                "attention_factor": 0.8,
                "beta_fast": 4.0,
                "beta_slow": 0.5,
                "truncate": False,
            }
        },
    ),
    # DeepSeek-V3 style: factor from max_position_embeddings / original
    "yarn-implicit-factor": ("Llama", {"rope_parameters": {**YARN, "factor": None}}),
    "yarn-partial-0.5": ("Llama", {"rope_parameters": YARN, "partial_rotary_factor": 0.5}),
    "default-partial-0.5": ("Phi3", {"partial_rotary_factor": 0.5}),
    "default-partial-0.75": ("Phi3", {"partial_rotary_factor": 0.75}),
    # Phi-3 writes the original context at the top level of config.json
    "longrope": (
        "Phi3",
        {"original_max_position_embeddings": ORIGINAL, "rope_parameters": longrope(16)},
    ),
    "longrope-factor": (
        "Phi3",
        {"original_max_position_embeddings": ORIGINAL, "rope_parameters": longrope(16, factor=2.0)},
    ),
    "longrope-partial-0.75": (
        "Phi3",
        {
            "original_max_position_embeddings": ORIGINAL,
            "partial_rotary_factor": 0.75,
            "rope_parameters": longrope(12),
        },
    ),
    "longrope-partial-0.5": (
        "Phi3",
        {
            "original_max_position_embeddings": ORIGINAL,
            "partial_rotary_factor": 0.5,
            "rope_parameters": longrope(8, attention_factor=1.3),
        },
    ),
}


def hf_config(case: str) -> Any:
    import transformers

    prefix, overrides = CASES[case]
    cls = getattr(transformers, f"{prefix}Config")
    return cls(**{**TINY, "max_position_embeddings": MAX_POS, **overrides})


def hf_cos_sin(case: str, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin, (len(positions), rotated dims), each position p from a fresh
    rotary module at the last token of a p + 1 token sequence (as a decode step sees it)."""
    prefix, name = CASES[case][0], CASES[case][0].lower()
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    rotary_cls = getattr(modeling, f"{prefix}RotaryEmbedding")
    hf = hf_config(case)
    rows = [rotary_cls(hf)(torch.zeros(1), torch.tensor([[p]])) for p in positions]
    return torch.cat([c[0] for c, _ in rows]), torch.cat([s[0] for _, s in rows])


def our_rope(case: str) -> ModelConfig:
    arch = f"{CASES[case][0]}ForCausalLM"
    return ModelConfig.from_hf({**hf_config(case).to_dict(), "architectures": [arch]})


@pytest.mark.parametrize("case", list(CASES))
def test_cos_sin_match_transformers(case: str) -> None:
    cfg = our_rope(case)
    rope, rot = cfg.rope, cfg.rotary_dim
    overrides = CASES[case][1]
    assert rope.type == (overrides.get("rope_parameters") or {}).get("rope_type", "default")
    assert rot == int(HEAD_DIM * overrides.get("partial_rotary_factor", 1.0))
    cos, sin = rope_cos_sin(rope, rot, MAX_POS, NUM_POS)
    assert cos.shape == sin.shape == (NUM_POS, rot // 2)
    hf_cos, hf_sin = hf_cos_sin(case, list(POSITIONS))
    assert hf_cos.shape == (len(POSITIONS), rot)  # cat(freqs, freqs): each angle twice
    torch.testing.assert_close(hf_cos[:, : rot // 2], hf_cos[:, rot // 2 :])
    rows = list(POSITIONS)
    torch.testing.assert_close(cos[rows], hf_cos[:, : rot // 2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[rows], hf_sin[:, : rot // 2], rtol=1e-6, atol=1e-6)
    if case != "default" and not case.startswith("default-"):  # the scaling bites
        plain = rope_cos_sin(RopeConfig(theta=rope.theta), rot, MAX_POS, NUM_POS)[1]
        assert not torch.allclose(sin[rows], plain[rows], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", [c for c in CASES if "yarn" in c or "longrope" in c])
def test_attention_factor_matches_transformers(case: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = our_rope(case).rope
    _, hf_factor = ROPE_INIT_FUNCTIONS[rope.type](hf_config(case))
    assert hf_factor != pytest.approx(1.0, abs=1e-3)  # so cos and sin are scaled
    assert attention_factor(rope, MAX_POS) == pytest.approx(hf_factor, rel=1e-12)
    cos, sin = rope_cos_sin(rope, 2 * len(rope.short_factor or [0] * 8), MAX_POS, 1)
    assert cos[0].tolist() == pytest.approx([hf_factor] * cos.shape[1], rel=1e-6)
    assert sin[0].abs().max() == 0


def test_longrope_switches_factors_at_the_original_context() -> None:
    rope = our_rope("longrope").rope
    assert rope.original_max_position_embeddings == ORIGINAL
    assert rope.factor == MAX_POS / ORIGINAL  # derived: Phi-3 writes no factor
    short = RopeConfig(
        theta=rope.theta,
        type="longrope",
        short_factor=rope.short_factor,
        long_factor=rope.short_factor,
        factor=rope.factor,
        original_max_position_embeddings=ORIGINAL,
    )
    ours, only_short = (rope_cos_sin(r, HEAD_DIM, MAX_POS, 100)[1] for r in (rope, short))
    torch.testing.assert_close(ours[:ORIGINAL], only_short[:ORIGINAL], rtol=0, atol=0)
    assert (ours[ORIGINAL:] - only_short[ORIGINAL:]).abs().amax(dim=1).min() > 1e-3


def test_longrope_prompt_past_the_original_context_differs_as_documented() -> None:
    """transformers rotates a whole prompt longer than the original context with the long
    factors; we rotate its first `original` positions with the short ones (the rope.py NOTE)."""
    import transformers

    hf = hf_config("longrope")
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf)
    _, prompt_sin = rotary(torch.zeros(1), torch.arange(ORIGINAL + 8)[None])
    sin = rope_cos_sin(our_rope("longrope").rope, HEAD_DIM, MAX_POS, ORIGINAL + 8)[1]
    half = HEAD_DIM // 2
    torch.testing.assert_close(sin[ORIGINAL:], prompt_sin[0, ORIGINAL:, :half])
    assert not torch.allclose(sin[1:ORIGINAL], prompt_sin[0, 1:ORIGINAL, :half], atol=1e-3)


@pytest.mark.parametrize(
    "case", ["default", "yarn", "yarn-partial-0.5", "default-partial-0.75", "longrope-partial-0.5"]
)
def test_rotary_table_matches_transformers(case: str) -> None:
    cfg = our_rope(case)
    rot = cfg.rotary_dim
    table = rotary_table(cfg.rope, HEAD_DIM, MAX_POS, NUM_POS)
    assert table.shape == (NUM_POS, HEAD_DIM // 2) and table.dtype == torch.complex64
    hf_cos, hf_sin = hf_cos_sin(case, list(POSITIONS))
    expected = torch.complex(hf_cos[:, : rot // 2], hf_sin[:, : rot // 2])
    torch.testing.assert_close(table[list(POSITIONS), : rot // 2], expected, rtol=1e-6, atol=1e-6)
    # the pairs past the rotated dims: the identity, not scaled by the attention factor
    assert (table[:, rot // 2 :] == 1).all()


@pytest.mark.parametrize(
    "case", ["yarn", "llama3", "yarn-partial-0.5", "longrope-partial-0.75", "longrope-partial-0.5"]
)
def test_interleaved_rotation_matches_rotate_half(case: str) -> None:
    """Our rotation (rows permuted by `interleave_rows`, pairs times the complex table) of a
    random q equals transformers' `apply_rotary_pos_emb` on the same q, permuted alike."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    cfg = our_rope(case)
    heads, rot = cfg.num_heads, cfg.rotary_dim
    positions = list(POSITIONS)
    torch.manual_seed(0)
    q = torch.randn(len(positions), heads, HEAD_DIM)  # (N, heads, head_dim), half-split layout
    hf_cos, hf_sin = hf_cos_sin(case, positions)  # (N, rot)
    # apply_rotary_pos_emb takes (B, heads, N, head_dim) and rotates the first `rot` dims
    hf_q, _ = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], q.transpose(0, 1)[None], hf_cos[None], hf_sin[None]
    )
    hf_q = hf_q[0].transpose(0, 1)  # (N, heads, head_dim)
    assert not torch.allclose(hf_q[..., :rot], q[..., :rot])
    torch.testing.assert_close(hf_q[..., rot:], q[..., rot:], rtol=0, atol=0)

    def interleave(x: torch.Tensor) -> torch.Tensor:  # (N, heads, head_dim), rows permuted
        rows = x.reshape(len(positions), heads * HEAD_DIM).T
        return interleave_rows(rows, heads, HEAD_DIM, rot).T.reshape(x.shape).contiguous()

    ours = interleave(q)
    table = rotary_table(cfg.rope, HEAD_DIM, MAX_POS, NUM_POS)
    cpu_kernels.rotary_embedding(ours, table[positions][:, None])
    torch.testing.assert_close(ours, interleave(hf_q), rtol=1e-5, atol=1e-5)


def test_gemma3_global_and_local_ropes() -> None:
    """A rope per layer type (transformers-5 nested `rope_parameters`): linear scaling on the
    global layers, a smaller theta on the windowed ones."""
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    hf = transformers.Gemma3TextConfig(
        **{**TINY, "max_position_embeddings": MAX_POS},
        head_dim=HEAD_DIM,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    cfg = ModelConfig.from_hf({**hf.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    rotary = Gemma3RotaryEmbedding(hf)
    positions = torch.tensor([list(POSITIONS)])
    for layer, layer_type in enumerate(hf.layer_types):
        rope = cfg.ropes[cfg.layer_ropes[layer]]
        _, hf_sin = rotary(torch.zeros(1), positions, layer_type)
        sin = rope_cos_sin(rope, HEAD_DIM, MAX_POS, NUM_POS)[1]
        torch.testing.assert_close(sin[list(POSITIONS)], hf_sin[0, :, : HEAD_DIM // 2])


def flat(params: dict[str, Any], **top: Any) -> dict[str, Any]:
    """A config.json in transformers-5 spelling (theta inside `rope_parameters`)."""
    return {"max_position_embeddings": MAX_POS, **top, "rope_parameters": params}


def legacy(params: dict[str, Any], **top: Any) -> dict[str, Any]:
    """The same in 4.x spelling: `rope_theta` at the top, `rope_scaling` with `type`."""
    scaling = {("type" if k == "rope_type" else k): v for k, v in params.items()}
    theta = scaling.pop("rope_theta", 10000.0)
    return {"max_position_embeddings": MAX_POS, **top, "rope_theta": theta, "rope_scaling": scaling}


@pytest.mark.parametrize(
    "params",
    [
        {**YARN, "rope_theta": 5e5, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 8},
        {**YARN, "attention_factor": 0.9, "beta_slow": 2.0, "truncate": False},
        {**YARN, "factor": None},
        longrope(16, rope_theta=2.5e5, original_max_position_embeddings=ORIGINAL),
        longrope(12, attention_factor=1.2, factor=8.0, original_max_position_embeddings=32),
    ],
)
def test_from_hf_reads_both_spellings(params: dict[str, Any]) -> None:
    new, old = RopeConfig.from_hf(flat(params)), RopeConfig.from_hf(legacy(params))
    assert new == old
    assert new.type == params["rope_type"]
    assert new.theta == params.get("rope_theta", 10000.0)
    assert new.original_max_position_embeddings == params["original_max_position_embeddings"]
    assert (
        new.factor == params.get("factor") or MAX_POS / params["original_max_position_embeddings"]
    )
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        assert getattr(new, key) == params.get(key)
    assert new.beta_fast == params.get("beta_fast", 32.0)
    assert new.beta_slow == params.get("beta_slow", 1.0)
    assert new.truncate == params.get("truncate", True)
    assert new.short_factor == tuple(params.get("short_factor", ()))
    assert new.long_factor == tuple(params.get("long_factor", ()))


def test_from_hf_phi3_conventions() -> None:
    params = longrope(16, original_max_position_embeddings=1024)
    # the top-level original context wins over the rope dict's (transformers' priority)
    top = RopeConfig.from_hf(flat(params, original_max_position_embeddings=ORIGINAL))
    assert top.original_max_position_embeddings == ORIGINAL
    assert RopeConfig.from_hf(flat(params)).original_max_position_embeddings == 1024
    # Phi3Config defaults it to 4096 when config.json has none at the top level
    phi3 = RopeConfig.from_hf(flat(params, model_type="phi3"))
    assert phi3.original_max_position_embeddings == 4096
    # Phi-3's earlier names for longrope: `su`, and `yarn` in a phi3 config
    for name in ("su", "yarn"):
        renamed = {**params, "rope_type": name}
        rope = RopeConfig.from_hf(legacy(renamed, model_type="phi3"))
        assert rope == phi3
    assert RopeConfig.from_hf(flat(YARN, model_type="llama")).type == "yarn"
    assert (
        RopeConfig.from_hf(flat(params, partial_rotary_factor=0.75)).partial_rotary_factor == 0.75
    )


def test_from_hf_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'proportional'"):
        RopeConfig.from_hf(flat({"rope_type": "proportional"}))
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'mrope'"):
        RopeConfig.from_hf(legacy({"rope_type": "mrope"}))
    with pytest.raises(ConfigError, match="short_factor"):
        RopeConfig.from_hf(flat({"rope_type": "longrope", "long_factor": [1.0] * 8}))
    # factors that do not match the rotated dims: refused when the table is built
    rope = RopeConfig.from_hf(flat(longrope(16)))
    with pytest.raises(ConfigError, match="longrope needs 4 short and long factors"):
        rope_cos_sin(rope, 8, MAX_POS, 4)


def hf_stepwise_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by transformers' forward one token at a time on its KV cache: each step
    rotates its token as transformers' rotary module does for a sequence of that length.
    (`generate` differs for Phi-3 past the original context: its prepare_inputs_for_generation
    drops the cache there and re-encodes the whole sequence with the long factors.)"""
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(res.logits[0, -1].argmax()))
            res = model(torch.tensor([out[-1:]]), past_key_values=res.past_key_values)
    return out


def test_phi3_longrope_parity_decoding_past_the_original_context(tmp_path: Path) -> None:
    """A tiny Phi-3 (partial rotary 0.5: 4 factors) with longrope from 16 positions to 64
    (attention factor sqrt(1 + ln 4 / ln 16)): prompts within the original context, greedy
    decoding well past it, against transformers step by step (short factors below 16, long
    ones from there on)."""
    path = make_family_checkpoint(
        tmp_path / "phi3",
        "phi3",
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_parameters=longrope(8),
    )
    llm = LLM(str(path))
    rope = llm.engine.config.model.rope
    assert (rope.type, rope.original_max_position_embeddings, rope.factor) == ("longrope", 16, 4)
    prompts = random_prompts(4, (6, 16), TINY["vocab_size"], seed=21)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    model = hf_model(path)
    assert ours == [hf_stepwise_greedy(model, p, 40) for p in prompts]
    # the rope.py NOTE: transformers' Phi-3 `generate` re-encodes at the crossing
    assert ours != hf_greedy(model, prompts, 40, eos=None)
