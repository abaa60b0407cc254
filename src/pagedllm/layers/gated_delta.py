"""Gated-DeltaNet linear attention (Qwen3-Next / Qwen3.5 `linear_attention` layers): the
causal depthwise conv1d over the mixed q/k/v projection and the gated delta rule, over a step's
flattened batch with one state slot per request.

A step's tokens are the requests' tokens concatenated (`GdnMeta.query_start_loc`, as the
attention backends take them), decodes (one new token) first. Each request owns a slot of the
layer's state pool (`GdnState`), named by `state_indices`; `has_initial_state` says whether the
request continues from its slot (a decode, a later prefill chunk) or starts from zeros (the
first chunk of a new request: the slot's stale contents are never read). Every function
updates the slots in place, so the next step continues where this one stopped.

Per token, with `GROUP = Hv // Hk` value heads per key head (head `h` reads key head
`h // GROUP`), q and k l2-normalized and q scaled by Dk^-0.5:

    S = exp(g) * S;   S += k (beta * (v - k^T S));   o = q^T S        S: (Dk, Dv) per head

CPU (fp32): the decodes as one step over the batch (the C++ kernels of csrc/gated_delta.cpp:
the conv update, then the rule in one pass over each (request, head) state; vectorized torch
where they are not built), a prefill by the chunked (WY / UT-transform) form, 64-token chunks
in matmuls. CUDA: the Triton kernels of `gated_delta_triton` (a fused recurrent
pass per (request, head, value block), prefill included). Both keep the state in fp32 and
round outputs once to the input dtype. transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule` / `causal_conv1d_*` are the oracle (tests/test_gated_delta.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.gdn_meta import GdnMeta

CHUNK = 64  # the chunked form's chunk length (tokens)


@dataclass(frozen=True)
class GdnShape:
    """A Gated-DeltaNet layer's sizes (HF config: linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        assert self.value_heads % self.key_heads == 0, "value heads: a multiple of key heads"
        assert self.conv_kernel >= 2

    @property
    def conv_dim(self) -> int:
        """The mixed projection's width: q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def new_state(
        self, slots: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> GdnState:
        """A zeroed state pool of `slots` requests; the conv state in the activations' dtype
        (it holds raw inputs), the recurrent state in fp32."""
        conv = torch.zeros(slots, self.conv_dim, self.conv_kernel - 1, dtype=dtype, device=device)
        shape = (slots, self.value_heads, self.key_dim, self.value_dim)
        return GdnState(conv, torch.zeros(shape, dtype=torch.float32, device=device))

    def split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output (T, conv_dim) as q, k (T, Hk, Dk) and v (T, Hv, Dv): views."""
        n, hk, dk = mixed.shape[0], self.key_heads, self.key_dim
        q, k, v = mixed.split([hk * dk, hk * dk, self.value_heads * self.value_dim], dim=-1)
        return q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, self.value_heads, self.value_dim)


@dataclass
class GdnState:
    """One layer's state pool: `conv` (slots, conv_dim, K-1), the last K-1 inputs of each
    channel, oldest first; `ssm` (slots, Hv, Dk, Dv) fp32, the recurrent state."""

    conv: torch.Tensor
    ssm: torch.Tensor


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta), (T, Hv) fp32: the log decay -exp(A_log) * softplus(a + dt_bias) and the
    write strength sigmoid(b), from the layer's a / b projections."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """The output norm: rms_norm(x) * weight * silu(z) over the last dim (HF's
    Qwen3_5RMSNormGated: normalized in fp32, rounded to x's dtype before the weight)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


# --- causal conv1d ------------------------------------------------------------------------------


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: GdnMeta,
    activation: str | None = "silu",
) -> torch.Tensor:
    """The depthwise causal conv over each request's tokens, after its slot's K-1 previous
    inputs (zeros for a new request): x (T, C), weight (C, K), bias (C,) or None; returns
    (T, C) in x's dtype and leaves each slot holding its request's last K-1 inputs."""
    assert activation in (None, "silu")
    if x.is_cuda:
        from pagedllm.layers.gated_delta_triton import causal_conv1d_triton

        return causal_conv1d_triton(x, weight, bias, conv_state, meta, activation)
    out = torch.empty_like(x)
    d = meta.num_decodes
    if d:
        idx = meta.state_indices[:d].long()
        init = meta.has_initial_state[:d]
        out[:d] = _conv_update(x[:d], weight, bias, conv_state, idx, init, activation)
    w = weight.t().float()  # (K, C)
    for r in range(d, len(meta.slots)):
        s, e, slot = meta.starts[r], meta.starts[r + 1], meta.slots[r]
        prev = conv_state[slot] if meta.continues[r] else torch.zeros_like(conv_state[slot])
        full = torch.cat([prev.t().to(x.dtype), x[s:e]]).float()  # (K-1+L, C)
        # the taps as K shifted multiply-adds (F.conv1d's depthwise CPU path was ~10x slower)
        y = (
            full[: e - s] * w[0]
            if bias is None
            else torch.addcmul(bias.float(), full[: e - s], w[0])
        )
        for j in range(1, w.shape[0]):
            y.addcmul_(full[j : j + e - s], w[j])
        out[s:e] = _activate(y, activation).to(x.dtype)
        conv_state[slot] = full[e - s :].t().to(conv_state.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per request, each continuing its slot: x (R, C) -> (R, C)."""
    init = torch.ones_like(state_indices)
    if x.is_cuda:
        n = x.shape[0]
        starts = torch.arange(n + 1, dtype=torch.int32, device=x.device)
        meta = GdnMeta(starts, state_indices, init, (), (), (), n, 1)
        from pagedllm.layers.gated_delta_triton import causal_conv1d_triton

        return causal_conv1d_triton(x, weight, bias, conv_state, meta, activation)
    return _conv_update(x, weight, bias, conv_state, state_indices.long(), init, activation)


def _conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    idx: torch.Tensor,
    init: torch.Tensor,
    activation: str | None,
    kernel: bool = True,
) -> torch.Tensor:
    """The decodes' conv: by the C++ kernel where it takes the inputs (and `kernel`)."""
    out = torch.empty_like(x)
    args = (x, weight, bias, conv_state, idx.int(), init.int(), activation == "silu")
    if kernel and _run_kernel("gdn_conv_update", out, *args):
        return out
    idx = idx.long()
    prev = torch.where(init.bool().view(-1, 1, 1), conv_state[idx], 0)  # (R, C, K-1)
    window = torch.cat([prev.to(x.dtype), x[:, :, None]], dim=2)  # (R, C, K)
    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_state[idx] = window[:, :, 1:].to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)


def _run_kernel(name: str, out: torch.Tensor, *args: object) -> bool:
    """Whether the C++ kernel `name` (csrc/gated_delta.cpp) wrote `out`: False where the
    extension is not built or the kernel does not take these inputs."""
    module = cpu_kernels.kernel_module()
    return module is not None and bool(getattr(module, name)(out, *args))


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


# --- the gated delta rule -----------------------------------------------------------------------


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    meta: GdnMeta,
    l2norm: bool = True,
) -> torch.Tensor:
    """The gated delta rule over a step: q, k (T, Hk, Dk), v (T, Hv, Dv) (views of the conv
    output are fine), g and beta (T, Hv) fp32 (`gdn_gating`); ssm_state (slots, Hv, Dk, Dv)
    fp32, updated in place. Returns o (T, Hv, Dv) in v's dtype."""
    if q.is_cuda:
        from pagedllm.layers.gated_delta_triton import gated_delta_triton

        return gated_delta_triton(q, k, v, g, beta, ssm_state, meta, l2norm)
    out = torch.empty(v.shape, dtype=v.dtype)
    d = meta.num_decodes
    if d:
        idx, init = meta.state_indices[:d], meta.has_initial_state[:d]
        out[:d] = _recurrent_step(
            q[:d], k[:d], v[:d], g[:d], beta[:d], ssm_state, idx, init, l2norm
        )
    for r in range(d, len(meta.slots)):
        s, e, slot = meta.starts[r], meta.starts[r + 1], meta.slots[r]
        h0 = ssm_state[slot] if meta.continues[r] else torch.zeros_like(ssm_state[slot])
        qr, kr = _prepare_qk(q[s:e], k[s:e], v.shape[1], l2norm)
        o, ssm_state[slot] = chunked_delta(qr, kr, v[s:e].float(), g[s:e], beta[s:e], h0)
        out[s:e] = o.to(v.dtype)
    return out


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    l2norm: bool = True,
) -> torch.Tensor:
    """One decode token per request (R of them), each continuing its slot: (R, Hv, Dv)."""
    init = torch.ones_like(state_indices, dtype=torch.int32)
    if q.is_cuda:
        n = q.shape[0]
        starts = torch.arange(n + 1, dtype=torch.int32, device=q.device)
        meta = GdnMeta(starts, state_indices, init, (), (), (), n, 1)
        from pagedllm.layers.gated_delta_triton import gated_delta_triton

        return gated_delta_triton(q, k, v, g, beta, ssm_state, meta, l2norm)
    return _recurrent_step(q, k, v, g, beta, ssm_state, state_indices, init, l2norm)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, value_heads: int, l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k in fp32, one per value head, normalized; q scaled by Dk^-0.5."""
    q, k = q.float(), k.float()
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    group = value_heads // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q * q.shape[-1] ** -0.5, k


def _recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    init: torch.Tensor,
    l2norm: bool,
    kernel: bool = True,
) -> torch.Tensor:
    """One token per request: (R, Hv, Dv) in v's dtype, by the C++ kernel where it takes the
    inputs (and `kernel`)."""
    out = torch.empty(v.shape, dtype=v.dtype)
    args = (q, k, v, g, beta, ssm_state, state_indices.int(), init.int(), l2norm)
    if kernel and _run_kernel("gated_delta_decode", out, *args):
        return out
    idx = state_indices.long()
    qf, kf = _prepare_qk(q, k, v.shape[1], l2norm)  # (R, Hv, Dk)
    h0 = torch.where(init.bool().view(-1, 1, 1, 1), ssm_state[idx], 0)  # a new request: zeros
    h = h0 * g.exp()[..., None, None]  # (R, Hv, Dk, Dv)
    kv = torch.einsum("rhk,rhkv->rhv", kf, h)
    delta = (v.float() - kv) * beta[..., None]
    h.add_(kf[..., :, None] * delta[..., None, :])
    ssm_state[idx] = h
    return torch.einsum("rhk,rhkv->rhv", qf, h).to(v.dtype)


def chunked_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens in the chunked form, all fp32: q (prepared), k (L, H, Dk), v
    (L, H, Dv), g, beta (L, H), h0 (H, Dk, Dv). Returns o (L, H, Dv) and the final state.

    Inside a chunk the delta rule's L sequential rank-1 updates are one triangular solve
    (the UT transform): u = T (beta v), w = T (beta exp(G) k), T = (I + tril(beta k k^T
    exp(G_i - G_j), -1))^-1, G the chunk's cumulative log decay; then per chunk
    v' = u - w S, o = exp(G) q S + (q k^T * D) v', S = exp(G_last) S + (exp(G_last - G) k)^T v'.
    """
    n = q.shape[0]
    pad = -n % chunk
    # (H, N, C, D): padded tokens have k = 0, beta = 0, g = 0: they change nothing
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).t() for t in (g, beta))
    hn = q.shape[0]
    q, k, v = (t.reshape(hn, -1, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(hn, -1, chunk), beta.reshape(hn, -1, chunk)
    cum = g.cumsum(-1)  # (H, N, C)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # the diagonal is ignored (unit)
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    # NOTE: the inverse (64 right-hand sides) then a matmul: batched LAPACK solves over the
    # 256 columns of u | w directly were ~15x slower on CPU
    eye = torch.eye(chunk).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    uw = inverse @ rhs
    u, w = uw.split([v.shape[-1], k.shape[-1]], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay  # (H, N, C, C)
    q_dec = q * cum.exp()[..., None]
    last = cum[..., -1:]
    k_dec = k * (last - cum).exp()[..., None]
    chunk_decay = last.exp()[..., None]  # (H, N, 1, 1)
    h = h0.clone()
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        v_new = u[:, i] - w[:, i] @ h
        out[:, i] = q_dec[:, i] @ h + attn[:, i] @ v_new
        h = h * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(hn, -1, v.shape[-1])[:, :n].transpose(0, 1)
    return out, h
