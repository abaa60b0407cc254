"""Latent-attention decode (model/mla.py) on the CPU: absorbed (W_uk folded into the query,
attention over the cached latents, W_uv after) against expanded (each request's context
expanded per head by kv_b_proj, then ordinary attention), printing JSON.

    .venv/bin/python benchmarks/mla_bench.py [--configs 1x256,1x1024,1x4096,8x1024]
        [--dtype float32|bfloat16] [--heads 16] [--repeats 5] [--output FILE]

One layer's decode step for (batch x context) at DeepSeek's per-head sizes (kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128); 16 heads is DeepSeek-V2-Lite's, and
a DeepSeek-V3 rank's at tensor-parallel 8. Medians of `--repeats`, 2 threads. Also the KV-cache
bytes per token of DeepSeek-V3 (61 layers, 128 heads, bf16) as the engine reports them
(`config.kv_bytes_per_token`: the latent rows) against per-head K/V.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from gemv_bench import median_ms  # benchmarks/ is the script's directory

from pagedllm.mla_config import MlaConfig
from pagedllm.model.mla import MlaWeights, attend_expanded, decode_absorbed

ARCH = "DeepseekV3ForCausalLM"
V3 = MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _weights(heads: int, dtype: torch.dtype) -> MlaWeights:
    m = V3
    kv_b = torch.randn(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank, dtype=dtype)
    kv_b /= m.kv_lora_rank**0.5
    empty = torch.empty(0)
    return MlaWeights(
        None, None, None, empty, empty, None, empty,
        kv_b[:, : m.qk_nope_head_dim], kv_b[:, m.qk_nope_head_dim :],
    )  # fmt: skip


def run(batch: int, context: int, heads: int, dtype: torch.dtype, repeats: int) -> dict:
    m, w = V3, _weights(heads, dtype)
    q_nope = torch.randn(batch, heads, m.qk_nope_head_dim, dtype=dtype)
    q_rope = torch.randn(batch, heads, m.qk_rope_head_dim, dtype=dtype)
    ctx = torch.randn(batch, context, m.cache_dim, dtype=dtype)
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool)
    row = torch.ones(1, context, dtype=torch.bool)
    scale = m.qk_head_dim**-0.5

    def absorbed() -> torch.Tensor:
        return decode_absorbed(q_nope, q_rope, ctx, mask, w, scale)

    def expanded() -> torch.Tensor:
        return torch.cat(
            [
                attend_expanded(q_nope[i : i + 1], q_rope[i : i + 1], ctx[i], row, w, scale)
                for i in range(batch)
            ]
        )

    diff = (absorbed().float() - expanded().float()).abs().max().item()
    a, e = median_ms([absorbed, expanded], repeats)
    return dict(
        batch=batch,
        context=context,
        absorbed_ms=round(a, 3),
        expanded_ms=round(e, 3),
        speedup=round(e / a, 2),
        max_abs_diff=diff,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="1x256,1x1024,1x4096,8x1024")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    results = []
    for spec in args.configs.split(","):
        batch, context = (int(v) for v in spec.split("x"))
        results.append(run(batch, context, args.heads, dtype, args.repeats))
    # DeepSeek-V3 itself (transformers' DeepseekV3Config defaults: 61 layers, 128 heads) in
    # bf16: the engine's own bytes per token (config.kv_bytes_per_token) against per-head K/V
    from transformers import DeepseekV3Config

    from pagedllm.config import kv_bytes_per_token
    from pagedllm.model_config import ModelConfig

    v3 = ModelConfig.from_hf({**DeepseekV3Config().to_dict(), "architectures": [ARCH]})
    assert v3.mla is not None
    latent = kv_bytes_per_token(v3, "auto", torch.bfloat16)
    per_head = v3.num_layers * v3.num_heads * (v3.mla.qk_head_dim + v3.mla.v_head_dim) * 2
    report = dict(
        shape=dict(
            heads=args.heads,
            **{
                k: getattr(V3, k)
                for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            },
        ),
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        load_average=os.getloadavg()[0],
        results=results,
        deepseek_v3_kv_bytes_per_token=dict(latent=latent, per_head_kv=per_head),
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
