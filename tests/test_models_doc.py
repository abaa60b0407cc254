"""docs/models.md's supported-models table is what the code supports and the tests check: one
row per architecture of pagedllm.families, its features as the config reader resolves them
from the config its parity tests use. `python tests/test_models_doc.py` rewrites the table."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hybrid_models import ARCHS as HYBRID
from hybrid_models import hf_config as hybrid_config

from conftest import ARCHS, TINY
from families import FAMILIES, family_config
from pagedllm.families import SUPPORTED_ARCHITECTURES
from pagedllm.model_config import ModelConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"
# architecture -> (the test config's name, the test file), for every tested architecture
CONFTEST = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


def _hf_config(arch: str) -> tuple[dict[str, Any], str]:
    """The config (as config.json holds it) the architecture's parity tests use, and where."""
    if arch in CONFTEST:
        import transformers

        name = CONFTEST[arch]
        cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        return cls(**{**TINY, **ARCHS[name]}).to_dict() | {
            "architectures": [arch]
        }, "test_parity.py"
    if arch in HYBRID:
        return hybrid_config(arch), "test_qwen35.py"
    name = next(n for n, (_, model_cls, _) in FAMILIES.items() if model_cls == arch)
    return family_config(name).to_dict() | {"architectures": [arch]}, "test_families.py"


def _features(cfg: ModelConfig) -> str:
    """What the resolved config turns on beyond the Llama decoder."""
    out = []
    if cfg.qkv_bias:
        out.append("q/k/v bias")
    if cfg.qk_norm:
        out.append(
            "q/k RMSNorm " + ("per head" if cfg.qk_norm == "head" else "over the projection")
        )
    out += {"pre": [], "sandwich": ["norms before and after attention and MLP"]}.get(
        cfg.norms, ["norms after attention and MLP only"]
    )
    if cfg.unit_offset_norm:
        out.append("(1 + w) norms")
    if cfg.activation != "silu":
        out.append({"gelu_tanh": "GeLU-tanh MLP", "gelu": "GeLU MLP"}[cfg.activation])
    scales = {"embeddings": cfg.embed_scale, "residual": cfg.residual_scale}
    scales["logits"] = cfg.logit_scale
    out += [f"{what} scaled" for what, scale in scales.items() if scale != 1.0]
    if cfg.attn_scale is not None:
        out.append("own softmax scale")
    if cfg.attn_softcap or cfg.final_softcap:
        out.append("attention and final-logit soft-caps")
    windows = set(cfg.layer_windows)
    if windows != {None}:
        out.append("sliding window" + (" on some layers" if None in windows else ""))
    if len(cfg.ropes) > 1:
        out.append("own rope on windowed layers")
    if None in cfg.layer_ropes:
        out.append("NoPE layers")
    if cfg.rotary_dim < cfg.head_dim:
        out.append("partial rotary")
    if cfg.rope.type != "default":
        out.append(f"{cfg.rope.type} rope scaling")
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size and cfg.mla is None:
        out.append("head_dim ≠ hidden / heads")
    if cfg.mla is not None:
        q = "q through a low-rank projection" if cfg.mla.q_lora_rank else "plain q_proj"
        rope = "" if cfg.mla.rope_interleave else ", half-split rope rows"
        out.append(f"multi-head latent attention ({q}, a paged cache of latents{rope})")
    if cfg.architecture == "Phi3ForCausalLM":
        out.append("fused q/k/v and gate/up in the checkpoint")
    if cfg.attn_sinks:
        out.append("attention sinks")
    if cfg.hybrid is not None:
        n, total = cfg.hybrid.num_linear, cfg.num_layers
        out.append(f"Gated-DeltaNet linear attention on {n} of {total} layers (conv1d and a "
                   "recurrent state per request, no KV cache), gated attention on the others")  # fmt: skip
    return ", ".join(out + _moe_features(cfg)) or "—"


def _moe_features(cfg: ModelConfig) -> list[str]:
    moe = cfg.moe
    if moe is None:
        return []
    routing = {
        "softmax": "softmax top-k" + (", renormalised" if moe.norm_topk_prob else ""),
        "topk_softmax": "softmax over the top-k logits",
        "sigmoid_grouped": f"sigmoid scores with a selection bias, the best {moe.topk_group} "
        f"of {moe.n_group} groups, renormalised, × {moe.routed_scaling}",
    }[moe.router]
    out = [f"MoE: {moe.num_experts} experts, top-{moe.top_k} ({routing})"]
    if moe.router_bias or moe.expert_bias:
        out.append("router and expert biases")
    if moe.activation == "swiglu_oai":
        out.append("clamped SwiGLU experts")
    if moe.shared_intermediate_size:
        out.append("gated shared expert" if moe.shared_gate else "shared expert")
    if not all(cfg.layer_moe):
        out.append("dense MLP layers among the sparse ones")
    if moe.oai_layout:
        out.append("stacked experts, gate/up interleaved, in the checkpoint")
    return out


def render_table() -> str:
    rows = [
        "| Architecture | What its tested config adds to the Llama decoder | Parity tests |",
        "|---|---|---|",
    ]
    for arch in SUPPORTED_ARCHITECTURES:
        hf, tests = _hf_config(arch)
        cfg = ModelConfig.from_hf(hf)
        rows.append(f"| `{arch}` | {_features(cfg)} | `tests/{tests}` |")
    return "\n".join(rows)


def _section(text: str) -> tuple[int, int]:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return start, end


def test_every_architecture_is_tested_against_hf() -> None:
    tested = set(CONFTEST) | {model_cls for _, model_cls, _ in FAMILIES.values()} | set(HYBRID)
    assert tested == set(SUPPORTED_ARCHITECTURES)


def test_the_docs_table_is_the_generated_one() -> None:
    text = DOC.read_text(encoding="utf-8")
    start, end = _section(text)
    assert text[start:end].strip() == render_table(), (
        "docs/models.md is stale: run `.venv/bin/python tests/test_models_doc.py`"
    )


if __name__ == "__main__":
    text = DOC.read_text(encoding="utf-8")
    start, end = _section(text)
    DOC.write_text(text[:start] + "\n" + render_table() + "\n" + text[end:], encoding="utf-8")
    sys.exit(0)
