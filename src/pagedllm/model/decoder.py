"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened batch of tokens.

The modules only hold parameters (named as the loader expects); the forward pass is plain
functions over per-layer weight tuples, which spares the per-module call overhead that
dominates small-batch decoding on a CPU.

NOTE: two layout choices differ from the HF checkpoint, both made by the loader:
- q/k/v and gate/up weights are fused into one matmul each;
- the rows of q and k are permuted within each head from the half-split rotary layout
  (pairs i, i + head_dim/2) to the interleaved one (pairs 2i, 2i+1), so the rotation is one
  complex multiply. Attention scores are dot products of q and k, unchanged by a permutation
  applied to both; the KV cache stores keys in the permuted order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.attention import AttentionBackend, cpu_kernels
from pagedllm.layers.attention.base import DecodeBatch, split_qkv
from pagedllm.layers.quant import QuantizedWeight, Weight, embedding, kernel_rows, linear

if TYPE_CHECKING:
    from pagedllm.distributed.comm import TPGroup
    from pagedllm.distributed.shard import ShardPlan


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, cfg.o_bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LayerWeights(NamedTuple):
    ln1: torch.Tensor
    qkv_w: Weight
    qkv_b: torch.Tensor | None
    o_w: Weight
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gate_up_w: Weight
    gate_up_b: torch.Tensor | None
    down_w: Weight
    down_b: torch.Tensor | None


class ForwardContext(NamedTuple):
    """Everything a step's layers share: the rotation of each token (complex, (N, 1, hd/2)),
    the KV caches, the attention backend and its per-step metadata."""

    rotary: torch.Tensor
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
    attn_metadata: Any


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, plan: ShardPlan | None = None, tp: TPGroup | None = None
    ) -> None:
        """`plan` and `tp`: this rank's shard of a tensor-parallel model (distributed.shard)
        and its collectives; then the modules have the shard's shapes (`self.config` its
        sizes) and the forward pass all-reduces and gathers."""
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.plan, self.tp = plan, tp
        cfg = cfg if plan is None else plan.local_config(cfg)
        self.config = cfg
        # NOTE: given its (uninitialized) weight: nn.Embedding's own init (normal_) on the meta
        # device imports torch._dynamo, 5 s of CPU at every engine start; the loader fills it
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # weights held quantized (layers.quant), by parameter name; their dense parameters
        # are left empty
        self.quantized: dict[str, QuantizedWeight] = {}
        self._weights: list[LayerWeights] = []
        # (embeddings, lm_head) as the forward pass uses them (a tuple: a Parameter assigned
        # to a module attribute would be registered again)
        self._io: tuple[Weight, Weight] = (self.embed_tokens.weight, self.lm_head.weight)
        # the layers' weights as csrc/decoder.cpp takes them, and up to how many decodes
        # (empty: the layers run op by op)
        self._kernel_weights: list[torch.Tensor] = []
        self._kernel_rows = 0.0

    def set_quantized(self, name: str, weight: QuantizedWeight) -> None:
        """Hold parameter `name` as `weight` (quantized) and free its dense tensor."""
        self.quantized[name] = weight
        param = self.get_parameter(name)
        param.data = param.data.new_empty(0)

    def weight(self, name: str) -> Weight:
        return self.quantized.get(name) or self.get_parameter(name)

    def finalize_weights(self) -> None:
        """Snapshot the per-layer weight tuples the forward pass uses (after loading)."""
        w = self.weight
        self._weights = [
            LayerWeights(
                l.input_layernorm.weight,
                w(f"layers.{i}.self_attn.qkv_proj.weight"),
                l.self_attn.qkv_proj.bias,
                w(f"layers.{i}.self_attn.o_proj.weight"),
                l.self_attn.o_proj.bias,
                l.post_attention_layernorm.weight,
                w(f"layers.{i}.mlp.gate_up_proj.weight"),
                l.mlp.gate_up_proj.bias,
                w(f"layers.{i}.mlp.down_proj.weight"),
                l.mlp.down_proj.bias,
            )
            for i, l in enumerate(self.decoder_layers())  # noqa: E741
        ]
        embed = w("embed_tokens.weight")
        self._io = (embed, embed if self.config.tie_word_embeddings else w("lm_head.weight"))
        self._kernel_weights, self._kernel_rows = self._decode_kernel_weights()

    def _decode_kernel_weights(self) -> tuple[list[torch.Tensor], float]:
        """The layers' weights flattened for `decode_layers` (csrc/decoder.cpp), and the most
        decodes it runs (the linear kernels' row limit); ([], 0) where it cannot run: tensor
        parallelism, not the CPU, no extension, attention or weights the kernels refuse."""
        cfg, norm = self.config, self.norm.weight
        module = cpu_kernels.kernel_module()
        if self.tp is not None or norm.device.type != "cpu" or module is None:
            return [], 0.0
        if not cpu_kernels.supports_shape(
            norm.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ):
            return [], 0.0
        flat: list[torch.Tensor] = []
        none = norm.new_empty(0)
        for w in self._weights:
            flat += [w.ln1, w.ln2]
            for weight, bias in (
                (w.qkv_w, w.qkv_b),
                (w.o_w, w.o_b),
                (w.gate_up_w, w.gate_up_b),
                (w.down_w, w.down_b),
            ):
                if isinstance(weight, QuantizedWeight):
                    flat += [
                        weight.qweight,
                        weight.scales,
                        none if weight.mins is None else weight.mins,
                    ]
                elif weight.shape[1] % 32 == 0:
                    flat += [weight, none, none]
                else:
                    return [], 0.0
                flat.append(none if bias is None else bias)
        linears = (
            w
            for layer in self._weights
            for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)
        )
        return flat, min(kernel_rows(w) for w in linears)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """(N,) token ids -> (S, vocab) fp32 logits of the tokens at `logits_indices` only."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        tp = self.tp
        x = self._embed(input_ids)
        decodes = ctx.backend.decode_batch(ctx.attn_metadata) if self._kernel_weights else None
        if decodes is not None and x.shape[0] <= self._kernel_rows:
            x = self._decode_layers(x, ctx, decodes)
        else:
            residual: torch.Tensor | None = None  # the stream the layers add to, as in vLLM
            for i, w in enumerate(self._weights):
                x, residual = _add_rms_norm(x, residual, w.ln1, eps)
                x = _attention(x, w, ctx, ctx.kv_caches[i], cfg, tp)
                x, residual = _add_rms_norm(x, residual, w.ln2, eps)
                gate_up = linear(x, w.gate_up_w, w.gate_up_b)
                x = _row_parallel(cpu_kernels.silu_and_mul(gate_up), w.down_w, w.down_b, tp)
            x, _ = _add_rms_norm(x, residual, self.norm.weight, eps)
        logits = linear(x[logits_indices], self._io[1]).float()
        if tp is None:
            return logits
        gathered = tp.gather_logits(logits)  # rank 0 samples; the others' logits go unused
        return logits if gathered is None else gathered[:, : self.vocab_size]

    def _decode_layers(self, x: torch.Tensor, ctx: ForwardContext, b: DecodeBatch) -> torch.Tensor:
        """The layers and the final norm of a step of decodes, in one C++ call: the same
        kernels in the same order as the op-by-op loop (csrc/decoder.cpp)."""
        cfg = self.config
        module = cpu_kernels.kernel_module()
        assert module is not None
        return module.decode_layers(
            x,
            self._kernel_weights,
            ctx.kv_caches,
            torch.view_as_real(ctx.rotary),
            b.slot_mapping,
            b.block_tables,
            b.context_lens,
            self.norm.weight,
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
            cfg.num_heads,
            cfg.num_kv_heads,
            b.sliding_window,
        )

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings; vocab-parallel: each rank looks up its own rows (zeros for
        the others'), then one all-reduce."""
        dtype = self.norm.weight.dtype
        if self.tp is None or self.plan is None:
            return embedding(ids, self._io[0], dtype)
        local = ids - self.plan.vocab_start
        outside = (local < 0) | (local >= self.plan.vocab_rows)
        x = embedding(local.masked_fill(outside, 0), self._io[0], dtype)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


def _row_parallel(
    x: torch.Tensor, w: Weight, bias: torch.Tensor | None, tp: TPGroup | None
) -> torch.Tensor:
    """A row-parallel linear: each rank's partial sum, all-reduced, then the bias."""
    if tp is None:
        return linear(x, w, bias)
    out = tp.all_reduce(linear(x, w))
    return out if bias is None else out.add_(bias)


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); the first call (no residual yet) starts it as x.
    Fused on the CPU (may overwrite x and residual in place)."""
    if residual is None:
        return cpu_kernels.rms_norm(x, weight, eps), x
    return cpu_kernels.fused_add_rms_norm(x, residual, weight, eps)


def _attention(
    x: torch.Tensor,
    w: LayerWeights,
    ctx: ForwardContext,
    kv_cache: torch.Tensor,
    cfg: ModelConfig,
    tp: TPGroup | None,
) -> torch.Tensor:
    n, h, kvh, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # (N, heads + 2 * kv_heads, head_dim): q heads, then k heads, then v heads
    qkv = linear(x, w.qkv_w, w.qkv_b).view(n, -1, hd)
    cpu_kernels.rotary_embedding(qkv[:, : h + kvh], ctx.rotary)  # q and k, in place, in fp32
    q, kv = split_qkv(qkv, h, kvh)
    o = ctx.backend.forward(q, kv, kv_cache, ctx.attn_metadata, hd**-0.5)
    return _row_parallel(o.reshape(n, h * hd), w.o_w, w.o_b, tp)
