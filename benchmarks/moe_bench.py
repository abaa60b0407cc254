"""Decode speed of a mixture of experts on this machine, printing one JSON document.

    .venv/bin/python benchmarks/moe_bench.py [--layers 4] [--dtype float32]

A Qwen3-MoE of Qwen3-30B-A3B's proportions scaled to this machine (hidden 512, 64 experts of
width 192, top-8: experts' width / hidden = 0.375 as there; `--layers` layers), random, built
with transformers' own classes, against:
- the same model with its experts run one by one (layers/moe.py `experts_loop`: a Python loop
  over the experts that have tokens, one matmul per projection each), the fused path's
  baseline;
- a dense Qwen3 of the same active parameters (MLP width 8 x 192 = 1536, the same attention).
Tokens per second of `LLM.generate` at batch 1 and 32 (64-token prompts, 64 new tokens,
greedy, ignore_eos), per path, and the ratios the issue asks for: fused / loop at batch 32,
dense / fused at batch 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from families_bench import tok_per_s

from families import make_family_checkpoint

ATTENTION = dict(
    vocab_size=32000,
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
EXPERTS, TOP_K, WIDTH = 64, 8, 192


def run(path: Path, dtype: str, loop: bool = False) -> dict[str, float]:
    from pagedllm import LLM
    from pagedllm.layers.moe import experts_loop
    from pagedllm.model import moe_block

    fused = moe_block.fused_experts
    if loop:
        moe_block.fused_experts = experts_loop  # type: ignore[assignment]
    try:
        llm = LLM(str(path), dtype=dtype, max_num_seqs=32, max_model_len=512)
        row = {"batch_1_tok_s": tok_per_s(llm, 1), "batch_32_tok_s": tok_per_s(llm, 32)}
    finally:
        moe_block.fused_experts = fused  # type: ignore[assignment]
    print(f"[bench] {path.name}{' (loop)' if loop else ''}: {row}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import torch

    moe = dict(
        ATTENTION,
        num_hidden_layers=args.layers,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=WIDTH,
        intermediate_size=TOP_K * WIDTH,
        norm_topk_prob=True,
        initializer_range=0.02,
    )
    dense = dict(ATTENTION, num_hidden_layers=args.layers, intermediate_size=TOP_K * WIDTH)
    with tempfile.TemporaryDirectory() as tmp:
        moe_path = make_family_checkpoint(Path(tmp) / "qwen3_moe", "qwen3_moe", **moe)
        dense_path = make_family_checkpoint(Path(tmp) / "qwen3_dense", "qwen3", **dense)
        rows = {
            "fused": run(moe_path, args.dtype),
            "loop": run(moe_path, args.dtype, loop=True),
            "dense_same_active": run(dense_path, args.dtype),
        }
    doc = {
        "moe": {k: v for k, v in moe.items() if k != "initializer_range"},
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": 64,
        "new_tokens": 64,
        "paths": rows,
        "fused_over_loop_batch_32": round(
            rows["fused"]["batch_32_tok_s"] / rows["loop"]["batch_32_tok_s"], 2
        ),
        "dense_over_fused_batch_1": round(
            rows["dense_same_active"]["batch_1_tok_s"] / rows["fused"]["batch_1_tok_s"], 2
        ),
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
