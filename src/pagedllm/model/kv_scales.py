"""An fp8 KV cache's per-layer scales (vLLM's `k_scale` / `v_scale`): keys stored as
k / k_scale and read back as fp8 * k_scale, values alike (`AttnLayer`). Read from the checkpoint
where it has them, under vLLM's names (ModelOpt's `k_proj.output_scale`, compressed-tensors'
`self_attn.k_scale`, the older `kv_scale` for both); else 1.0, or estimated from the first
forward's keys and values (`calculate_kv_scales`: amax / the format's largest value)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from pagedllm.kv_cache_dtype import FP8, storage_dtype

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.layers.attention.base import AttentionBackend, AttnLayer
    from pagedllm.model.decoder import CausalLM

_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?([\w.]+)$")
# suffix -> the scales it sets (k, v); the others of vLLM's (queries', probabilities') are
# read past: no kernel here quantizes those
_KINDS = {
    "k_proj.output_scale": "k",
    "v_proj.output_scale": "v",
    "k_scale": "k",
    "v_scale": "v",
    "kv_scale": "kv",
    "q_proj.output_scale": "",
    "q_scale": "",
    "prob_scale": "",
}

Scales = dict[int, tuple[float, float]]  # layer -> (k_scale, v_scale)


def kind(name: str) -> tuple[int, str] | None:
    """(layer, "k" / "v" / "kv" / "" (ignored)) of a checkpoint's KV-scale tensor; None for
    any other tensor."""
    m = _SCALE.search(name)
    if m is None or m.group(2) not in _KINDS:
        return None
    return int(m.group(1)), _KINDS[m.group(2)]


def take(name: str, tensor: torch.Tensor, scales: Scales) -> bool:
    """Record `tensor` in `scales` if it is a KV scale (its largest value, as vLLM reads a
    per-tensor scale); whether it was one."""
    found = kind(name)
    if found is None:
        return False
    layer, which = found
    if which:
        value = float(tensor.float().max())
        k, v = scales.get(layer, (1.0, 1.0))
        scales[layer] = (value if "k" in which else k, value if "v" in which else v)
    return True


class ScaleEstimator:
    """Wraps an attention backend for one forward: each attention layer's scales become
    amax(|k|) / fp8 max and amax(|v|) / fp8 max of the keys and values it writes (over this
    rank's heads), applied from that write on; `scales` lists them in call (layer) order."""

    def __init__(self, inner: AttentionBackend, fp8_max: float) -> None:
        self.inner, self.fp8_max = inner, fp8_max
        self.scales: list[tuple[float, float]] = []

    def build_metadata(self, step: object) -> object:
        return self.inner.build_metadata(step)  # type: ignore[arg-type]

    def decode_batch(self, metadata: object) -> None:
        return None  # the layer-by-layer path, through `forward`

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
        layer: AttnLayer,
    ) -> torch.Tensor:
        amax = kv.float().abs().amax(dim=(0, 2, 3)) / self.fp8_max  # (2,): keys, values
        k, v = amax.clamp_min(torch.finfo(torch.float32).tiny).tolist()
        self.scales.append((k, v))
        return self.inner.forward(q, kv, kv_cache, metadata, layer._replace(k_scale=k, v_scale=v))


def install(model: CausalLM, estimated: list[tuple[float, float]]) -> None:
    """Give the model's attention layers (in order: a hybrid model's linear layers have no
    KV cache) the `ScaleEstimator`'s scales; `model.kv_scales` keeps them."""
    attention = [i for i, w in enumerate(model.layer_weights) if w.gdn is None]
    assert len(attention) == len(estimated), (len(attention), len(estimated))
    for i, (k, v) in zip(attention, estimated, strict=True):
        model.kv_scales[i] = (k, v)
        w = model.layer_weights[i]
        model.layer_weights[i] = w._replace(attn=w.attn._replace(k_scale=k, v_scale=v))


def estimator(
    config: EngineConfig, model: CausalLM, backend: AttentionBackend
) -> ScaleEstimator | None:
    """The estimator of the first forward where the engine asks for one
    (`calculate_kv_scales`), its cache is fp8 and the checkpoint had no scales; else None."""
    kind = config.cache.cache_dtype
    if not config.cache.calculate_kv_scales or kind not in FP8 or model.kv_scales:
        return None
    return ScaleEstimator(backend, torch.finfo(storage_dtype(kind, config.dtype)).max)
