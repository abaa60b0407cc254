"""Decode speed of a mixture of experts on this machine, printing one JSON document.

    .venv/bin/python benchmarks/moe_bench.py [--layers 4] [--dtype float32] [--rounds 2]
        [--batches 1 32] [--threads N] [--clock wall|cpu]

A Qwen3-MoE of Qwen3-30B-A3B's proportions scaled to this machine (hidden 512, 64 experts of
width 192, top-8: experts' width / hidden = 0.375 as there; `--layers` layers), random, built
with transformers' own classes, decoding as the engine does (a step of decodes in one C++
call, csrc/decoder.cpp, the experts in csrc/moe.cpp's fused kernel), against:
- the same model op by op from Python, the experts still fused (`fused_ops`: what the one
  call saves);
- the same model with its experts run one by one (layers/moe.py `experts_loop`: a Python loop
  over the experts that have tokens, one matmul per projection each; op by op), the fused
  path's baseline;
- a dense Qwen3 of the same active parameters (MLP width 8 x 192 = 1536, the same attention).
Tokens per second of `LLM.generate` at batch 1 and 32 (64-token prompts, 64 new tokens,
greedy, ignore_eos), per path (the best of `--rounds` rounds, the paths taking turns), the
fastest forward pass of a step at each batch (ms, wall time: robust to a busy machine, as the
minimum over the run's steps), and the ratios the issue asks for: fused / loop at batch 32,
dense / fused at batch 1 (by tok/s and by step).
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
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def load(path: Path, dtype: str, one_call: bool = True) -> Any:
    """An LLM over the checkpoint at `path`; `one_call` False: its steps op by op from Python
    (not csrc/decoder.cpp's one-call decode)."""
    from pagedllm import LLM

    llm = LLM(str(path), dtype=dtype, max_num_seqs=32, max_model_len=512)
    if not one_call:
        llm.engine.runner.model._kernel_weights = []
    return llm


def measure(
    llm: Any, batch: int, clock: Callable[[], float], loop: bool = False
) -> tuple[float, float]:
    """Decode tok/s at `batch` by `clock`, and the fastest forward pass of its steps of `batch`
    decodes (ms of wall time: the model alone, the least disturbed); `loop`: the experts one by one
    (`experts_loop`)."""
    from pagedllm.layers.moe import experts_loop
    from pagedllm.model import moe_block

    model, fused = llm.engine.runner.model, moe_block.fused_experts
    steps: list[float] = []

    def timed(input_ids: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = forward(input_ids, *args)
        if input_ids.shape[0] == batch:  # a step of `batch` decodes
            steps.append(time.perf_counter() - start)
        return out

    forward, model.forward = model.forward, timed
    if loop:
        moe_block.fused_experts = experts_loop  # type: ignore[assignment]
    try:
        return tok_per_s(llm, batch, clock), round(min(steps) * 1e3, 3)
    finally:
        moe_block.fused_experts = fused  # type: ignore[assignment]
        model.forward = forward


def race(
    llms: dict[str, Any], rounds: int, clock: Callable[[], float], batches: list[int]
) -> dict[str, dict[str, Any]]:
    """Each path's best tok/s over `rounds` rounds, the paths taking turns within a round (on
    a shared machine the least disturbed run of each, measured side by side)."""
    best: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        for name, llm in llms.items():
            row = best.setdefault(
                name,
                {"decode_path": "one_call" if llm.engine.runner.model._kernel_weights else "ops"}
                | {f"batch_{b}_tok_s": 0.0 for b in batches}
                | {f"batch_{b}_step_ms": float("inf") for b in batches},
            )
            for batch in batches:
                tok_s, step_ms = measure(llm, batch, clock, loop=name == "loop")
                row[f"batch_{batch}_tok_s"] = max(row[f"batch_{batch}_tok_s"], tok_s)
                row[f"batch_{batch}_step_ms"] = min(row[f"batch_{batch}_step_ms"], step_ms)
            print(f"[bench] round {r} {name}: {row}", file=sys.stderr, flush=True)
    return best


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The issue's ratios, of the batches measured."""
    fused, loop, dense = rows["fused"], rows["loop"], rows["dense_same_active"]
    out = {}
    if "batch_32_tok_s" in fused:
        out["fused_over_loop_batch_32"] = round(fused["batch_32_tok_s"] / loop["batch_32_tok_s"], 2)
    if "batch_1_tok_s" in fused:
        out["dense_over_fused_batch_1"] = round(dense["batch_1_tok_s"] / fused["batch_1_tok_s"], 2)
        step = fused["batch_1_step_ms"] / dense["batch_1_step_ms"]
        out["dense_over_fused_batch_1_step"] = round(step, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="wall time, or the process's CPU time (meant for --threads 1 on a busy machine)",
    )
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

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
        llms = {
            "fused": load(moe_path, args.dtype),
            "fused_ops": load(moe_path, args.dtype, one_call=False),
            "loop": load(moe_path, args.dtype, one_call=False),
            "dense_same_active": load(dense_path, args.dtype),
        }
        rows = race(llms, args.rounds, CLOCKS[args.clock], args.batches)
    doc = {
        "moe": {k: v for k, v in moe.items() if k != "initializer_range"},
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": 64,
        "new_tokens": 64,
        "rounds": args.rounds,
        "clock": args.clock,
        "paths": rows,
        **ratios(rows),
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
