"""Where an fp8 KV cache loses on SmolLM2-135M: each layer's keys and values (after the rotary
embedding, HF transformers' own cache, fp32) over the first window of the fixed text, stored
and read back as each cache stores them. Prints one JSON document.

    .venv/bin/python benchmarks/kv_fp8_error.py [--model DIR] [--tokens 512]

Per layer and K/V: the largest |x|; the share of values an e4m3 cache of scale 1.0 saturates
(|x| > 448) or holds as subnormals (0 < |x| < 2^-6, fewer mantissa bits); and the relative
RMS error ||x - read(write(x))|| / ||x|| of e4m3 with scale 1.0, with a per-layer scale
(`calculate_kv_scales`: amax / 448), with a scale per KV head (the same over each head), of
e5m2 (scale 1.0) and of int8 (a scale per token and head).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from peers_parts import common

from pagedllm.layers.attention import kv_quant
from pagedllm.prepare import prepare_smollm2

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
E4M3_MIN_NORMAL = 2.0**-6


def rel_error(x: torch.Tensor, back: torch.Tensor) -> float:
    return round(float((x - back).norm() / x.norm()), 5)


def fp8_round_trip(
    x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float
) -> torch.Tensor:
    return kv_quant.quantize_fp8(x / scale, dtype).float() * scale


def layer_stats(x: torch.Tensor) -> dict[str, Any]:
    """x: (kv_heads, tokens, head_dim) of one layer's keys or values."""
    ax = x.abs()
    per_layer = float(ax.amax()) / E4M3_MAX
    per_head = ax.amax(dim=(1, 2), keepdim=True) / E4M3_MAX  # (kv_heads, 1, 1)
    int8 = kv_quant.dequantize_int8(kv_quant.quantize_int8(x), torch.float32)
    return {
        "amax": round(float(ax.amax()), 3),
        "head_amax": [round(float(a), 3) for a in ax.amax(dim=(1, 2))],
        "saturated_e4m3": round(float((ax > E4M3_MAX).float().mean()), 6),
        "subnormal_e4m3": round(float(((ax > 0) & (ax < E4M3_MIN_NORMAL)).float().mean()), 4),
        "err_e4m3": rel_error(x, fp8_round_trip(x, E4M3, 1.0)),
        "err_e4m3_layer_scale": rel_error(x, fp8_round_trip(x, E4M3, per_layer)),
        "err_e4m3_head_scale": rel_error(x, fp8_round_trip(x, E4M3, per_head)),
        "err_e5m2": rel_error(x, fp8_round_trip(x, torch.float8_e5m2, 1.0)),
        "err_int8": rel_error(x, int8),
    }


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each (batch, kv_heads, tokens, head_dim), of an HF cache."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(common.THREADS)
    model_dir = args.model or str(prepare_smollm2())
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = tok(common.text(), return_tensors="pt").input_ids[:, : args.tokens]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = []
    for i, (k, v) in enumerate(cache_layers(cache)):
        layers.append({"layer": i, "k": layer_stats(k[0].float()), "v": layer_stats(v[0].float())})
    summary = {
        f"{kv}_{name}_mean": round(sum(row[kv][name] for row in layers) / len(layers), 5)
        for kv in ("k", "v")
        for name in (
            "err_e4m3",
            "err_e4m3_layer_scale",
            "err_e4m3_head_scale",
            "err_e5m2",
            "err_int8",
        )
    }
    print(
        json.dumps(
            {"model": model_dir, "tokens": ids.shape[1], "summary": summary, "layers": layers},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
