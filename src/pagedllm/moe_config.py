"""The mixture-of-experts part of a model's configuration, read from its HF `config.json`:
how many experts, how tokens are routed to them, which layers have them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.errors import ConfigError

# how the router turns its logits into the top-k experts and their weights (model/moe_block.py)
# - "softmax": softmax over all experts (fp32), the top k, renormalised when `norm_topk_prob`
#   (Mixtral always; Qwen2/3-MoE by the flag);
# - "topk_softmax": the top k logits (with the router's bias), then softmax over those k (gpt-oss);
# - "sigmoid_grouped": sigmoid scores (router in fp32); experts chosen by score + a correction
#   bias within the best `topk_group` of `n_group` groups; weights the chosen scores,
#   renormalised, times `routed_scaling` (DeepSeek-V3)
ROUTERS = ("softmax", "topk_softmax", "sigmoid_grouped")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    router: str  # one of ROUTERS
    norm_topk_prob: bool = True
    router_bias: bool = False  # the router linear has a bias (gpt-oss)
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    # one shared expert every token goes through (0: none), its output times sigmoid(gate(x))
    # where `shared_gate` (Qwen2-MoE); DeepSeek's n_shared_experts are one of their total width
    shared_intermediate_size: int = 0
    shared_gate: bool = True
    activation: str = "silu"  # the experts' (layers/moe.py ACTIVATIONS)
    limit: float = 7.0  # swiglu_oai's clamp
    # the routing weights rounded to the model's dtype before they weight the experts
    # (Qwen2/3-MoE cast them; Mixtral and gpt-oss keep fp32 / the logits' dtype)
    weights_in_model_dtype: bool = False
    # the checkpoint stacks the experts as gpt-oss does: gate_up (E, H, 2I) with gate and up
    # interleaved, down (E, I, H) (else transformers' stacked layout (E, 2I, H), (E, H, I),
    # or one tensor per expert and projection)
    oai_layout: bool = False
    # sigmoid_grouped
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0


def from_hf(
    hf: dict[str, Any], kind: str, num_layers: int, activation: str
) -> tuple[MoeConfig, tuple[bool, ...]]:
    """The MoE settings of a family whose MoE `kind` is "mixtral", "qwen_moe", "gpt_oss" or
    "deepseek", and
    which layers are sparse (the others keep the dense MLP)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    top_k = hf.get("num_experts_per_tok")
    if not experts or not top_k:
        raise ConfigError("a mixture-of-experts config needs num_experts and num_experts_per_tok")
    if not 0 < top_k <= experts:
        raise ConfigError(f"num_experts_per_tok {top_k} must be in 1..{experts}")
    sparse = (True,) * num_layers
    if kind == "mixtral":
        cfg = MoeConfig(experts, top_k, hf["intermediate_size"], "softmax", activation=activation)
    elif kind == "qwen_moe":
        cfg = MoeConfig(
            experts,
            top_k,
            hf["moe_intermediate_size"],
            "softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            shared_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            activation=activation,
            weights_in_model_dtype=True,
        )
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(hf.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    elif kind == "gpt_oss":
        if float(hf.get("swiglu_alpha", 1.702)) != 1.702:
            raise ConfigError(f"unsupported swiglu_alpha {hf['swiglu_alpha']} (gpt-oss's is 1.702)")
        cfg = MoeConfig(
            experts,
            top_k,
            hf["intermediate_size"],
            "topk_softmax",
            router_bias=True,
            expert_bias=True,
            activation="swiglu_oai",
            limit=float(hf.get("swiglu_limit", 7.0)),
            oai_layout=True,
        )
    elif kind == "deepseek":
        width = hf["moe_intermediate_size"]
        groups, chosen = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        if experts % groups or not 0 < chosen <= groups:
            raise ConfigError(
                f"n_group {groups} / topk_group {chosen} do not fit {experts} experts"
            )
        cfg = MoeConfig(
            experts,
            top_k,
            width,
            "sigmoid_grouped",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            shared_intermediate_size=width * int(hf.get("n_shared_experts") or 0),
            shared_gate=False,
            activation=activation,
            n_group=groups,
            topk_group=chosen,
            routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        )
        first = int(hf.get("first_k_dense_replace") or 0)  # the first layers are dense
        sparse = tuple(i >= first for i in range(num_layers))
    else:
        raise ValueError(f"unknown MoE kind {kind!r}")
    return cfg, sparse
