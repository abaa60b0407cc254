"""Decode speed and state memory of a hybrid model (Qwen3.5) on this machine, printing one JSON
document.

    .venv/bin/python benchmarks/hybrid_bench.py [--layers 8] [--dtype float32]

A Qwen3.5 text model scaled to this machine (hidden 512, every 4th layer gated full attention,
the others Gated-DeltaNet with 4 key / 8 value heads of 64; random, built with transformers'
own classes), against the same model with every layer full attention. Tokens per second of
`LLM.generate` at batch 1 and 32 (64-token prompts, 64 new tokens, greedy, ignore_eos), and
from the engine's own config: one request's linear-attention state (bytes, over its linear
layers) against the KV bytes of one 16-token block, the trade a per-block state snapshot for
prefix caching would make.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from families_bench import tok_per_s

from conftest import build_tokenizer

SHAPE: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def build(path: Path, layer_types: list[str], **shape: Any) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(**shape, layer_types=layer_types)
    transformers.Qwen3_5ForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


def run(path: Path, dtype: str) -> dict[str, Any]:
    from pagedllm import LLM

    llm = LLM(str(path), dtype=dtype, max_num_seqs=32, max_model_len=512)
    cfg = llm.engine.config
    row: dict[str, Any] = {"batch_1_tok_s": tok_per_s(llm, 1), "batch_32_tok_s": tok_per_s(llm, 32)}
    size = cfg.dtype.itemsize
    row["kv_bytes_per_16_token_block"] = (
        16 * cfg.model.num_kv_layers * cfg.model.kv_values_per_token() * size
    )
    hybrid = cfg.model.hybrid
    if hybrid is not None:
        row["state_bytes_per_request"] = hybrid.state_bytes_per_slot(size)
        row["state_slots"] = cfg.cache.num_state_slots
    print(f"[bench] {path.name}: {row}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import torch

    n = args.layers
    hybrid = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    shape = dict(SHAPE, num_hidden_layers=n)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {
            "hybrid": run(build(Path(tmp) / "hybrid", hybrid, **shape), args.dtype),
            "all_attention": run(
                build(Path(tmp) / "attention", ["full_attention"] * n, **shape), args.dtype
            ),
        }
    doc = {
        "shape": dict(shape, layer_types=hybrid),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": 64,
        "new_tokens": 64,
        "models": rows,
        "state_over_block_kv": round(
            rows["hybrid"]["state_bytes_per_request"]
            / rows["hybrid"]["kv_bytes_per_16_token_block"],
            1,
        ),
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
