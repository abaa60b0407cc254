"""How a Llama-family model splits over `world` tensor-parallel ranks (Megatron's layout, as
vLLM does it):

- q/k/v and gate/up are column-parallel: each rank holds its heads' rows (and intermediate
  rows) and computes them with no communication;
- o_proj and down_proj are row-parallel: each rank holds the matching input columns, and
  their partial outputs are summed by one all-reduce each (their biases added after it);
- the embedding is vocab-parallel (each rank a contiguous range of rows: a masked lookup,
  then an all-reduce) and so is lm_head (each rank its vocab range of logits, gathered on
  rank 0, which samples). The vocabulary is padded to a multiple of `world`.

KV heads split across ranks when `world` divides them; with fewer KV heads than ranks, each
KV head is replicated on `world / num_kv_heads` ranks (each rank then holds one).

Latent attention (model/mla.py) splits its heads: q_b_proj (or q_proj) and kv_b_proj by rows
per head, o_proj by columns; q_a_proj, kv_a_proj_with_mqa and their norms are replicated, so
every rank computes and caches the same latent.

A hybrid's Gated-DeltaNet layers (model/gdn_block.py) split by heads too: the fused input
projection's q/k shards by key heads, v/z/b/a by value heads, the conv channels with them,
o_proj by columns; so each rank keeps its heads' share of every request's state.

A GGUF file's quantized weights are cut between their blocks of 32 inputs (worker/executor.py `engine_plan`): a
row-parallel weight it holds in blocks (o_proj, down_proj, each expert's down) splits only
where each rank's share of its inputs is whole blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedllm.errors import ConfigError
from pagedllm.model_config import ModelConfig

# the inputs of one block of a GGUF file's quantized weights (Q8_0 / Q4_0 / Q4_1)
BLOCK = 32
# the row-parallel modules (each rank holds some of their inputs), as an error names them
_ROW_PARALLEL = {
    "o_proj": "attention output",
    "down_proj": "MLP",
    "experts_down": "experts'",
    "shared_down": "shared expert's",
}


def valid_sizes(
    cfg: ModelConfig, limit: int = 64, blocked: frozenset[str] = frozenset()
) -> list[int]:
    """The tensor-parallel sizes up to `limit` this model can be split into (`blocked`: as
    ShardPlan.create takes it)."""
    return [n for n in range(1, limit + 1) if _why_not(cfg, n, blocked) is None]


def _input_widths(cfg: ModelConfig) -> dict[str, int]:
    """The whole input width of each row-parallel module (0: the model has none)."""
    moe = cfg.moe
    return {
        "o_proj": cfg.num_heads * (cfg.mla.v_head_dim if cfg.mla else cfg.head_dim),
        "down_proj": cfg.intermediate_size,
        "experts_down": moe.intermediate_size if moe else 0,
        "shared_down": moe.shared_intermediate_size if moe else 0,
    }


def _why_not_blocks(cfg: ModelConfig, world: int, blocked: frozenset[str]) -> str | None:
    """A row-parallel weight held in blocks of BLOCK inputs is cut between blocks only."""
    for module, width in _input_widths(cfg).items():
        if module in blocked and (width // world) % BLOCK:
            return (
                f"its {_ROW_PARALLEL[module]} width {width} does not split {world} ways into "
                f"whole {BLOCK}-wide blocks of its GGUF file ({width // world} inputs a rank)"
            )
    return None


def _why_not(cfg: ModelConfig, world: int, blocked: frozenset[str] = frozenset()) -> str | None:
    h, kvh = cfg.num_heads, cfg.num_kv_heads
    if h % world:
        return f"its {h} attention heads do not split {world} ways"
    if kvh >= world and kvh % world:
        return f"its {kvh} KV heads do not split {world} ways"
    if kvh < world and world % kvh:
        return f"its {kvh} KV heads cannot be replicated evenly over {world} ranks"
    if cfg.intermediate_size % world:
        return f"its MLP width {cfg.intermediate_size} does not split {world} ways"
    moe = cfg.moe
    if moe is not None and moe.intermediate_size % world:
        return f"its experts' width {moe.intermediate_size} does not split {world} ways"
    hybrid = cfg.hybrid
    if hybrid is not None and (hybrid.key_heads % world or hybrid.value_heads % world):
        return f"its linear-attention heads ({hybrid.key_heads} / {hybrid.value_heads}) do not split {world} ways"
    if moe is not None and moe.shared_intermediate_size % world:
        return (
            f"its shared expert's width {moe.shared_intermediate_size} does not split {world} ways"
        )
    return _why_not_blocks(cfg, world, blocked)


def _mla_widths(cfg: ModelConfig) -> tuple[int, int, int] | None:
    mla = cfg.mla
    if mla is None:
        return None
    return mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim, mla.v_head_dim


def _gdn(cfg: ModelConfig, world: int) -> tuple[int, int, int, int, frozenset[int]] | None:
    h = cfg.hybrid
    if h is None:
        return None
    layers = frozenset(i for i, linear in enumerate(h.layer_linear) if linear)
    return h.key_heads // world, h.value_heads // world, h.key_dim, h.value_dim, layers


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` holds (every size in rows of the HF tensors)."""

    rank: int
    world: int
    num_heads: int  # local attention heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # the first KV head this rank holds
    intermediate: int  # local MLP width
    vocab_rows: int  # local embedding / lm_head rows (the padded vocabulary / world)
    expert_intermediate: int = 0  # local width of each expert (every expert is split)
    shared_intermediate: int = 0  # local width of the shared expert
    # latent attention: per head, the rows of q_b_proj / q_proj and of kv_b_proj, and
    # o_proj's input columns (None: no latent attention)
    mla_widths: tuple[int, int, int] | None = None
    # a hybrid's linear layers (model/gdn_block.py): local key heads, local value heads, key
    # and value head dims, and which layers they are (None: no linear layers)
    gdn: tuple[int, int, int, int, frozenset[int]] | None = None

    @staticmethod
    def create(
        cfg: ModelConfig, rank: int, world: int, blocked: frozenset[str] = frozenset()
    ) -> ShardPlan:
        """Raises ConfigError (naming the sizes that work) when `world` cannot split `cfg`.
        `blocked`: the row-parallel modules (o_proj, down_proj, experts_down, shared_down)
        whose weights are held in blocks of BLOCK inputs, which a rank's part must not cut."""
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"tensor-parallel rank {rank} of {world} is out of range")
        why = _why_not(cfg, world, blocked)
        if why is not None:
            sizes = ", ".join(map(str, valid_sizes(cfg, blocked=blocked)))
            raise ConfigError(
                f"tensor_parallel_size {world} cannot split this model: {why} "
                f"(sizes that can: {sizes})"
            )
        kvh = cfg.num_kv_heads
        local_kv = max(1, kvh // world)
        kv_start = rank * local_kv if kvh >= world else rank // (world // kvh)
        return ShardPlan(
            rank=rank,
            world=world,
            num_heads=cfg.num_heads // world,
            num_kv_heads=local_kv,
            kv_head_start=kv_start,
            intermediate=cfg.intermediate_size // world,
            vocab_rows=-(-cfg.vocab_size // world),
            expert_intermediate=cfg.moe.intermediate_size // world if cfg.moe else 0,
            shared_intermediate=cfg.moe.shared_intermediate_size // world if cfg.moe else 0,
            mla_widths=_mla_widths(cfg),
            gdn=_gdn(cfg, world),
        )

    def _mla_slice(self, module: str, kind: str) -> tuple[int, int, int] | None:
        q, kv, v = self.mla_widths or (0, 0, 0)
        dim, width = {"q_b_proj": (0, q), "q_proj": (0, q), "kv_b_proj": (0, kv)}.get(
            module, (1, v) if module == "o_proj" and kind == "weight" else (0, 0)
        )
        return (dim, self.rank * self.num_heads * width, self.num_heads * width) if width else None

    def _gdn_slice(self, parts: list[str], shard: int | None) -> tuple[int, int, int] | None:
        """A linear layer's parameter: the in_proj / conv shards' rows of this rank's heads,
        its per-value-head decay parameters, o_proj's matching columns; the gated norm's weight
        (per value dim) is replicated."""
        assert self.gdn is not None
        hk, hv, dk, dv, layers = self.gdn
        module, kind = parts[-2], parts[-1]
        if len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) not in layers:
            return None
        width = None
        if module in ("in_proj", "conv1d") and shard is not None:
            width = [hk * dk, hk * dk, hv * dv, hv * dv, hv, hv][shard]
        elif kind in ("dt_bias", "A_log"):
            width = hv
        elif module == "o_proj" and kind == "weight":
            return 1, self.rank * hv * dv, hv * dv
        return None if width is None else (0, self.rank * width, width)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this rank's sizes: the modules built from it have the shards' shapes."""
        moe = cfg.moe and dataclasses.replace(
            cfg.moe,
            intermediate_size=self.expert_intermediate,
            shared_intermediate_size=self.shared_intermediate,
        )
        return dataclasses.replace(
            cfg,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab_rows,
            moe=moe,
            hybrid=cfg.hybrid
            and dataclasses.replace(
                cfg.hybrid,
                key_heads=cfg.hybrid.key_heads // self.world,
                value_heads=cfg.hybrid.value_heads // self.world,
            ),
        )

    def slice_of(
        self, ours: str, shard: int | None, head_dim: int, qk_norm: str | None = None
    ) -> tuple[int, int, int] | None:
        """(dim, start, length) of the full HF tensor for our parameter `ours` (and its fused
        `shard`: 0/1/2 = q/k/v, 0/1 = gate/up) on this rank; None: the rank holds all of it.
        `qk_norm`: the model's (ModelConfig.qk_norm); a norm over the whole q or k projection
        splits with its heads."""
        parts = ours.split(".")
        module, kind = parts[-2], parts[-1]
        if self.mla_widths is not None and (per_head := self._mla_slice(module, kind)):
            return per_head
        if self.gdn is not None and (per_head := self._gdn_slice(parts, shard)):
            return per_head
        if module == "q_norm" and qk_norm == "proj":
            shard = 0
        elif module == "k_norm" and qk_norm == "proj":
            shard = 1
        if module == "qkv_proj" or (module in ("q_norm", "k_norm") and qk_norm == "proj"):
            if shard in (0, 3):  # q heads' rows, or (gated attention) their gates'
                return 0, self.rank * self.num_heads * head_dim, self.num_heads * head_dim
            return 0, self.kv_head_start * head_dim, self.num_kv_heads * head_dim
        # column-parallel: this rank's rows of each shard (of each expert's, per expert)
        widths = {
            "gate_up_proj": self.intermediate,
            "experts_gate_up": self.expert_intermediate,
            "shared_gate_up": self.shared_intermediate,
        }
        if module in widths:
            return 0, self.rank * widths[module], widths[module]
        if module == "self_attn" and kind == "sinks":  # one per query head
            return 0, self.rank * self.num_heads, self.num_heads
        if kind == "bias":  # row-parallel biases are added once, after the all-reduce
            return None
        if module == "o_proj":
            return 1, self.rank * self.num_heads * head_dim, self.num_heads * head_dim
        # row-parallel: the matching input columns
        widths = {
            "down_proj": self.intermediate,
            "experts_down": self.expert_intermediate,
            "shared_down": self.shared_intermediate,
        }
        if module in widths:
            return 1, self.rank * widths[module], widths[module]
        if module in ("embed_tokens", "lm_head"):
            return 0, self.vocab_start, self.vocab_rows
        return None
