"""The decoder of every dense family (families.py) over a flattened batch of tokens: the
Llama layer, with the parts a family's config turns on (q/k norms, norms after attention and
MLP, soft-caps, per-layer windows and ropes, NoPE layers, multipliers, GeLU).

The modules only hold parameters (named as the loader expects); the forward pass is plain
functions over per-layer weight tuples, which spares the per-module call overhead that
dominates small-batch decoding on a CPU.

NOTE: two layout choices differ from the HF checkpoint, both made by the loader:
- q/k/v and gate/up weights are fused into one matmul each;
- the rows of q and k are permuted within each head from the half-split rotary layout
  (pairs i, i + rotary_dim/2) to the interleaved one (pairs 2i, 2i+1), so the rotation is one
  complex multiply. Attention scores are dot products of q and k, unchanged by a permutation
  applied to both; the KV cache stores keys in the permuted order (and q/k norm weights are
  permuted with them).
Where the family's RMSNorm scales by (1 + w) the loader stores 1 + w; a residual multiplier is
folded into o_proj and down_proj.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.attention.base import AttnLayer, DecodeBatch, split_qkv
from pagedllm.layers.quant import QuantizedWeight, Weight, embedding, linear
from pagedllm.model import decoder_kernel
from pagedllm.model.decoder_ops import act_and_mul, join, row_parallel
from pagedllm.model.decoder_types import ForwardContext, LayerWeights
from pagedllm.model.gdn_block import GdnAttention, gdn_forward, gdn_weights
from pagedllm.model.mla import MlaAttention, mla_forward, mla_weights
from pagedllm.model.moe_block import MoeBlock, moe_forward, moe_weights

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
        gate = q_size if cfg.hybrid else 0  # gated attention: q_proj's per-head output gates
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size + gate, cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm is not None:  # over each head, or over the whole projection
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(cfg.head_dim if per_head else q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else kv_size, cfg.rms_norm_eps)
        if cfg.attn_sinks:  # a logit per head
            self.sinks = nn.Parameter(torch.empty(cfg.num_heads))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)


# the layer norms of each placement (families.Family.norms), by Gemma's names: before
# attention, after it, before the MLP, after it
NORMS = {
    "pre": ("input_layernorm", "pre_feedforward_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn: Attention | MlaAttention | GdnAttention = (
            (Attention(cfg) if cfg.mla is None else MlaAttention(cfg))
            if not cfg.hybrid or not cfg.hybrid.layer_linear[index]
            else GdnAttention(cfg)
        )
        moe = cfg.moe if cfg.layer_moe and cfg.layer_moe[index] else None
        self.mlp: MLP | MoeBlock = MLP(cfg) if moe is None else MoeBlock(cfg, moe)
        for name in NORMS[cfg.norms]:
            self.add_module(name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def norm(self, name: str) -> torch.Tensor | None:
        module = getattr(self, name, None)
        return None if module is None else module.weight


class CausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, plan: ShardPlan | None = None, tp: TPGroup | None = None
    ) -> None:
        """`plan` and `tp`: this rank's shard of a tensor-parallel model (distributed.shard)
        and its collectives; then the modules have the shard's shapes (`self.config` its
        sizes) and the forward pass all-reduces and gathers."""
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.plan, self.tp = plan, tp
        # ranks that hold each KV head (a whole-projection k norm sums over them)
        self._kv_replicas = 1 if plan is None else max(1, plan.world // cfg.num_kv_heads)
        cfg = cfg if plan is None else plan.local_config(cfg)
        self.config = cfg
        # NOTE: given its (uninitialized) weight: nn.Embedding's own init (normal_) on the meta
        # device imports torch._dynamo, 5 s of CPU at every engine start; the loader fills it
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # weights held quantized (layers.quant), by parameter name; their dense parameters
        # are left empty
        self.quantized: dict[str, QuantizedWeight] = {}
        self.layer_weights: list[LayerWeights] = []
        # an fp8 cache's (k_scale, v_scale) by layer, from the checkpoint (model/kv_scales.py)
        self.kv_scales: dict[int, tuple[float, float]] = {}
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
        w, cfg = self.weight, self.config
        self.layer_weights = []
        for i, l in enumerate(self.decoder_layers()):  # noqa: E741
            # an MlaAttention where the model has latent attention (read by mla_weights only)
            attn, mlp = cast(Attention, l.self_attn), l.mlp
            gdn = gdn_weights(l.self_attn, w, i, cfg.hybrid)  # None: not a linear layer
            qk, mla = cfg.qk_norm is not None and gdn is None, None
            if cfg.mla is not None:
                mla = mla_weights(cast(MlaAttention, attn), cfg.mla, w, f"layers.{i}.self_attn")
            dense = isinstance(mlp, MLP)
            moe = None
            if isinstance(mlp, MoeBlock) and cfg.moe is not None:
                moe = moe_weights(mlp, cfg.moe, w, f"layers.{i}.mlp", self.plan)
            self.layer_weights.append(
                LayerWeights(
                    l.norm("input_layernorm"),
                    None if mla or gdn else w(f"layers.{i}.self_attn.qkv_proj.weight"),
                    None if mla or gdn else attn.qkv_proj.bias,
                    attn.q_norm.weight if qk else None,
                    attn.k_norm.weight if qk else None,
                    w(f"layers.{i}.self_attn.o_proj.weight"),
                    attn.o_proj.bias,
                    l.norm("post_attention_layernorm"),
                    l.norm("pre_feedforward_layernorm"),
                    w(f"layers.{i}.mlp.gate_up_proj.weight") if dense else None,
                    mlp.gate_up_proj.bias if isinstance(mlp, MLP) else None,
                    w(f"layers.{i}.mlp.down_proj.weight") if dense else None,
                    mlp.down_proj.bias if isinstance(mlp, MLP) else None,
                    l.norm("post_feedforward_layernorm"),
                    AttnLayer(
                        cfg.softmax_scale,
                        cfg.layer_windows[i],
                        cfg.attn_softcap,
                        attn.sinks.float() if cfg.attn_sinks else None,
                        *self.kv_scales.get(i, (1.0, 1.0)),
                    ),
                    cfg.layer_ropes[i],
                    moe,
                    mla,
                    gdn,
                )
            )
        embed = w("embed_tokens.weight")
        self._io = (embed, embed if cfg.tie_word_embeddings else w("lm_head.weight"))
        if cfg.hybrid is None:  # csrc/decoder.cpp: softmax attention, latent or not
            self._kernel_weights, self._kernel_rows = decoder_kernel.flatten(self)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """(N,) token ids -> (S, vocab) fp32 logits of the tokens at `logits_indices` only."""
        cfg = self.config
        x = self._scaled_embed(input_ids)
        lora = decoder_kernel.lora_args(ctx.lora, x.dtype)  # None: adapters run op by op
        fused = self._kernel_weights and lora is not None
        decodes = decoder_kernel.decode_batch(ctx, cfg.mla is not None) if fused else None
        if decodes is not None and lora is not None and x.shape[0] <= self._kernel_rows:
            x = self._decode_layers(x, ctx, decodes, lora)
        else:
            x = self._layers(x, ctx)
        logits = linear(x[logits_indices], self._io[1]).float()
        if cfg.logit_scale != 1.0:
            logits *= cfg.logit_scale
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        if self.tp is None:
            return logits
        gathered = self.tp.gather_logits(logits)  # rank 0 samples; the others' go unused
        return logits if gathered is None else gathered[:, : self.vocab_size]

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """(N,) token ids -> (N, hidden): every token's last hidden state, after the final
        norm (what a pooling model pools: `pagedllm.pooling`)."""
        return self._layers(self._scaled_embed(input_ids), ctx)

    def _scaled_embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self._embed(ids)
        if self.config.embed_scale != 1.0:  # in the model's dtype, as transformers scales it
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def _layers(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The layers op by op, then the final norm. `x` is the pending output of the last
        block (the embeddings first), `residual` the stream it joins (as in vLLM)."""
        eps = self.config.rms_norm_eps
        residual: torch.Tensor | None = None
        post: torch.Tensor | None = None  # the norm the pending output takes before it joins
        for i, w in enumerate(self.layer_weights):
            x, residual = join(x, residual, post, w.ln1, eps)
            x = self._attention(x, w, ctx, i)
            x, residual = join(x, residual, w.post1, w.ln2, eps)
            x = self._mlp(x, w, ctx, i)
            post = w.post2
        x, _ = join(x, residual, post, self.norm.weight, eps)
        return x

    def _mlp(self, x: torch.Tensor, w: LayerWeights, ctx: ForwardContext, i: int) -> torch.Tensor:
        cfg, lora = self.config, ctx.lora
        if w.moe is not None and cfg.moe is not None:
            return moe_forward(x, w.moe, cfg.moe, cfg.activation, self.tp)
        assert w.gate_up_w is not None and w.down_w is not None
        gate_up = linear(x, w.gate_up_w, w.gate_up_b)
        if lora is not None:
            lora.add(i, "gate_up", x, gate_up)
        h = act_and_mul(gate_up, cfg.activation)
        return row_parallel(
            h, w.down_w, w.down_b, self.tp, None if lora is None else partial(lora.add, i, "down")
        )

    def _attention(
        self, x: torch.Tensor, w: LayerWeights, ctx: ForwardContext, i: int
    ) -> torch.Tensor:
        cfg, kv_cache, lora = self.config, ctx.kv_caches[i], ctx.lora
        if w.mla is not None and cfg.mla is not None:  # over the torch backend's metadata
            rotary = None if w.rope is None else ctx.rotary[w.rope]
            eps, scale, m = cfg.rms_norm_eps, w.attn.scale, ctx.attn_metadata
            o = mla_forward(x, w.mla, cfg.mla, eps, rotary, kv_cache, m, scale)
            return row_parallel(o, w.o_w, w.o_b, self.tp)
        if w.gdn is not None and cfg.hybrid is not None and ctx.gdn is not None:
            o = gdn_forward(x, w.gdn, cfg.hybrid, ctx.gdn, cfg.rms_norm_eps)
            return row_parallel(o, w.o_w, w.o_b, self.tp)
        n, h, kvh, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        assert w.qkv_w is not None
        qkv = linear(x, w.qkv_w, w.qkv_b)
        if lora is not None:
            lora.add(i, "qkv", x, qkv)
        # (N, heads + 2 * kv_heads, head_dim): q heads, then k heads, then v heads (then the
        # q heads' output gates: gated attention)
        qkv = qkv.view(n, -1, hd)
        if w.q_norm is not None and w.k_norm is not None:
            q, k = qkv[:, :h], qkv[:, h : h + kvh]
            q.copy_(self._qk_norm(q, w.q_norm, 1))
            k.copy_(self._qk_norm(k, w.k_norm, self._kv_replicas))
        if w.rope is not None:  # q and k, in place, in fp32
            cpu_kernels.rotary_embedding(qkv[:, : h + kvh], ctx.rotary[w.rope])
        q, kv = split_qkv(qkv[:, : h + 2 * kvh], h, kvh)
        o = ctx.backend.forward(q, kv, kv_cache, ctx.attn_metadata, w.attn).reshape(n, h * hd)
        if cfg.hybrid is not None:  # gated attention: o * sigmoid(gate), per head
            o = o * torch.sigmoid(qkv[:, h + 2 * kvh :].reshape(n, h * hd))
        o_lora = None if lora is None else partial(lora.add, i, "o")
        return row_parallel(o, w.o_w, w.o_b, self.tp, o_lora)

    def _qk_norm(self, t: torch.Tensor, weight: torch.Tensor, replicas: int) -> torch.Tensor:
        """RMSNorm of q or k (N, heads, head_dim): per head, or over the whole projection
        (which tensor parallelism splits: the sum of squares is all-reduced, counting a
        replicated KV head once)."""
        eps = self.config.rms_norm_eps
        if self.config.qk_norm == "head":
            return cpu_kernels.rms_norm(t, weight, eps)
        flat = t.reshape(t.shape[0], -1)
        if self.tp is None:
            return cpu_kernels.rms_norm(flat, weight, eps).view(t.shape)
        squares = self.tp.all_reduce(flat.float().square().sum(-1, keepdim=True))
        size = flat.shape[1] * self.tp.world // replicas
        normed = flat.float() * torch.rsqrt(squares / size + eps)
        return (normed * weight.float()).to(t.dtype).view(t.shape)

    def _decode_layers(
        self, x: torch.Tensor, ctx: ForwardContext, b: DecodeBatch, lora: tuple[Any, ...]
    ) -> torch.Tensor:
        """The layers and the final norm of a step of decodes, in one C++ call: the same
        kernels in the same order as the op-by-op loop (csrc/decoder.cpp), LoRA included."""
        cfg = self.config
        module = cpu_kernels.kernel_module()
        assert module is not None
        return module.decode_layers(
            x,
            self._kernel_weights,
            ctx.kv_caches,
            [torch.view_as_real(r) for r in ctx.rotary],
            cfg.layer_windows,
            cfg.layer_ropes,
            b.slot_mapping,
            b.block_tables,
            b.context_lens,
            self.norm.weight,
            cfg.rms_norm_eps,
            cfg.softmax_scale,
            cfg.attn_softcap or 0.0,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.activation,
            *decoder_kernel.moe_args(cfg.moe),
            *lora,
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
