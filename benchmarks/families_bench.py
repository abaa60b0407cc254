"""Decode speed of every model family on this machine, printing one JSON document.

    .venv/bin/python benchmarks/families_bench.py [--families qwen3,gemma2] [--layers 8]

Each family's checkpoint (and Llama's, the baseline) is a random one of a SmolLM2-like shape (hidden 576, 9 query / 3 KV
heads of 64, MLP 1536; `--layers` layers, 8 by default), built with transformers' own classes
from the tiny test configs (tests/families.py: each family's features switched on, its
windows and soft-caps included), saved in fp32. Per family: tokens per second of
`LLM.generate` at batch 1 and 32 (64-token prompts, 64 new tokens, greedy, ignore_eos), and
which decode path ran (`fused`: the whole step in one C++ call, csrc/decoder.cpp; `ops`: the
layers op by op). A regression in one family's feature path shows as its row moving alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import make_checkpoint
from families import DENSE, LAYER_TYPES, make_family_checkpoint

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
)
PROMPT, NEW = 64, 64


def shape(name: str, layers: int) -> dict[str, Any]:
    """SHAPE with `layers` layers, the per-layer patterns of the test configs repeated."""
    out: dict[str, Any] = dict(SHAPE, num_hidden_layers=layers)
    if name == "gemma3":
        out["layer_types"] = (LAYER_TYPES * layers)[:layers]
    if name == "smollm3":
        out["no_rope_layers"] = [(i + 1) % 2 for i in range(layers)]
    if name == "gemma2":
        out["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
    return out


def tok_per_s(llm: Any, batch: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Decode tok/s of `batch` requests; `clock`: wall time, or e.g. `time.process_time` (the
    process's CPU seconds: on one thread, what a busy machine's other processes leave out)."""
    from pagedllm import SamplingParams

    prompts = [
        {"prompt_token_ids": [100 + (i * 7 + j) % 4000 for j in range(PROMPT)]}
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    start = clock()
    llm.generate(prompts, params, use_tqdm=False)
    return round(batch * NEW / (clock() - start), 1)


def bench(name: str, root: Path, layers: int) -> dict[str, Any]:
    from pagedllm import LLM

    if name == "llama":  # the baseline: tests/conftest.py's Llama
        path = make_checkpoint(root / name, name, **shape(name, layers))
    else:
        path = make_family_checkpoint(root / name, name, **shape(name, layers))
    llm = LLM(str(path), dtype="float32", max_num_seqs=32, max_model_len=1024)
    model = llm.engine.runner.model
    row = {
        "architecture": llm.engine.config.model.architecture,
        "decode_path": "fused" if model._kernel_weights else "ops",
        "batch_1_tok_s": tok_per_s(llm, 1),
        "batch_32_tok_s": tok_per_s(llm, 32),
    }
    print(f"[bench] {name}: {row}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--families", default="llama," + ",".join(DENSE))
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    import torch

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            rows[name] = bench(name, Path(tmp), args.layers)
    doc = {
        "shape": dict(SHAPE, num_hidden_layers=args.layers),
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "prompt_tokens": PROMPT,
        "new_tokens": NEW,
        "families": rows,
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
