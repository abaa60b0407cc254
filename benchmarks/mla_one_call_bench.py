"""A DeepSeek-V3 decode step in one C++ call against the same step op by op, printing JSON.

    .venv/bin/python benchmarks/mla_one_call_bench.py [--quick] [--layers 4] [--dtype float32]
        [--rounds 2] [--batches 1 8 32] [--settings 1:cpu 2:wall] [--new-tokens 64]

A small random DeepSeek-V3 built with transformers' own classes (hidden 512, 8 heads, latent
attention with q_lora_rank 192, kv_lora_rank 128, nope / rope / v head dims 32 / 16 / 32; 16
routed experts of width 128 in 4 groups, top-4 of the best 2 groups, one shared expert, the
first layer dense; `--layers` layers), decoding as the engine does: a step of decodes in one
C++ call (csrc/decoder.cpp with csrc/mla_decode.cpp: latent attention, the grouped sigmoid
router, the fused experts) against the same model with its layers op by op from Python (the
same kernels and ATen ops: what the one call saves is the returns to Python). Per setting
(`threads:clock`, as benchmarks/moe_bench.py: one thread by the process's CPU clock, then two
threads by the wall clock), per path and batch (64-token prompts, `--new-tokens` greedy
tokens; the paths take turns within each of `--rounds` rounds, each keeps its best round):
`batch_B_step_ms`, the median forward pass of the run's steps of B decodes, its
`batch_B_decode_tok_s`, and `batch_B_tok_s` of the whole `LLM.generate`; `ops_over_one_call_
batch_B`: the op-by-op step's time over the one call's. `--quick`: one round of 32 new tokens
(under 3 minutes on a quiet 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from moe_bench import CLOCKS, document, load, race  # benchmarks/ is the script's directory

from families import make_family_checkpoint  # tests/ (moe_bench puts it on the path)

MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,  # the dense first layer's MLP
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=128,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=2048,
    initializer_range=0.02,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--settings", nargs="+", default=["1:cpu", "2:wall"])
    ap.add_argument("--quick", action="store_true", help="one round of 32 new tokens")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 1, 32
    import torch

    model = dict(MODEL, num_hidden_layers=args.layers)
    settings = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_family_checkpoint(Path(tmp) / "deepseek_v3", "deepseek_v3", **model)
        llms = {"one_call": load(path, args.dtype), "ops": load(path, args.dtype, False)}
        assert llms["one_call"].engine.runner.model._kernel_weights, "no one-call path"
        for setting in args.settings:
            threads, clock = setting.split(":")
            torch.set_num_threads(int(threads))
            rows = race(llms, args.rounds, CLOCKS[clock], args.batches, args.new_tokens)
            one, ops = rows["one_call"], rows["ops"]
            settings[setting] = {"threads": int(threads), "clock": clock, "paths": rows} | {
                f"ops_over_one_call_batch_{b}": round(
                    ops[f"batch_{b}_step_ms"] / one[f"batch_{b}_step_ms"], 2
                )
                for b in args.batches
            }
    print(json.dumps(document("model", model, args, settings), indent=2))


if __name__ == "__main__":
    main()
