"""Decode speed of a mixture of experts on this machine, printing one JSON document.

    .venv/bin/python benchmarks/moe_bench.py [--quick] [--layers 4] [--experts 128]
        [--dtype bfloat16] [--rounds 2] [--batches 1 32] [--settings 1:cpu 2:wall]
        [--new-tokens 64]

A Qwen3-MoE of Qwen3-30B-A3B's proportions scaled to this machine (hidden 512, 128 experts
of width 192, top-8: its expert count and top-k, experts' width / hidden = 0.375 as there;
bf16 weights, as its checkpoint ships; `--layers` layers), random, built with transformers'
own classes, decoding as the engine does (a step of decodes in one C++
call, csrc/decoder.cpp, the experts in csrc/moe.cpp's fused kernel), against:
- the same model op by op from Python, the experts still fused (`fused_ops`: what the one
  call saves);
- the same model with its experts run one by one (layers/moe.py `experts_loop`: a Python loop
  over the experts that have tokens, one matmul per projection each; op by op), the fused
  path's baseline;
- a dense Qwen3 of the same active parameters (MLP width 8 x 192 = 1536, the same attention).
Per setting (`threads:clock`: by default one thread timed by the process's CPU clock, robust
to a busy machine, then two threads by the wall clock, what a user sees), per path and batch
(64-token prompts, `--new-tokens` greedy tokens, ignore_eos; the paths take turns within each
of `--rounds` rounds, and each keeps its best round):
- `batch_B_decode_tok_s`: B / the median forward pass of the run's steps of B decodes (the
  model alone: what the experts' kernel changes), and `batch_B_step_ms` that median;
- `batch_B_tok_s`: tokens per second of the whole `LLM.generate` (the prefill of the B
  prompts included: it runs the experts one by one on every path, past the kernel's rows).
The ratios the issue asks for, per setting: fused / loop at batch 32 and dense / fused at
batch 1, by decode steps and end to end. `--quick`: one round of 32 new tokens (a few
minutes on a quiet 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

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
EXPERTS, TOP_K, WIDTH = 128, 8, 192  # Qwen3-30B-A3B's experts and top-k
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
PROMPT = 64


def moe_config(layers: int, experts: int = EXPERTS) -> dict[str, Any]:
    """The Qwen3-MoE of Qwen3-30B-A3B's proportions, `layers` layers (transformers' names)."""
    return dict(
        ATTENTION,
        num_hidden_layers=layers,
        num_experts=experts,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=WIDTH,
        intermediate_size=TOP_K * WIDTH,
        norm_topk_prob=True,
        initializer_range=0.02,
    )


def load(path: Path, dtype: str, one_call: bool = True) -> Any:
    """An LLM over the checkpoint at `path`; `one_call` False: its steps op by op from Python
    (not csrc/decoder.cpp's one-call decode)."""
    from pagedllm import LLM

    llm = LLM(str(path), dtype=dtype, max_num_seqs=32, max_model_len=512)
    if not one_call:
        llm.engine.runner.model._kernel_weights = []
    return llm


def measure(
    llm: Any, batch: int, clock: Callable[[], float], new_tokens: int, loop: bool = False
) -> dict[str, float]:
    """One `LLM.generate` of `batch` requests timed by `clock`: its tok/s, and the median
    forward pass of its steps of `batch` decodes (ms) with the decode tok/s that gives; `loop`:
    the experts one by one (`experts_loop`)."""
    from pagedllm import SamplingParams
    from pagedllm.layers.moe import experts_loop
    from pagedllm.model import moe_block

    model, fused = llm.engine.runner.model, moe_block.fused_experts
    steps: list[float] = []

    def timed(input_ids: Any, *args: Any) -> Any:
        start = clock()
        out = forward(input_ids, *args)
        if input_ids.shape[0] == batch:  # a step of `batch` decodes
            steps.append(clock() - start)
        return out

    prompts = [
        {"prompt_token_ids": [100 + (i * 7 + j) % 4000 for j in range(PROMPT)]}
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    forward, model.forward = model.forward, timed
    if loop:
        moe_block.fused_experts = experts_loop  # type: ignore[assignment]
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        steps.clear()
        start = clock()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = clock() - start
    finally:
        moe_block.fused_experts = fused  # type: ignore[assignment]
        model.forward = forward
    step = statistics.median(steps)
    return {
        "tok_s": round(batch * new_tokens / elapsed, 1),
        "decode_tok_s": round(batch / step, 1),
        "step_ms": round(step * 1e3, 3),
    }


def race(
    llms: dict[str, Any], rounds: int, clock: Callable[[], float], batches: list[int], new: int
) -> dict[str, dict[str, Any]]:
    """Each path's best figures over `rounds` rounds, the paths taking turns within a round (on
    a shared machine the least disturbed run of each, measured side by side)."""
    best: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        for batch in batches:
            for name, llm in llms.items():
                path = "one_call" if llm.engine.runner.model._kernel_weights else "ops"
                row = best.setdefault(name, {"decode_path": path})
                got = measure(llm, batch, clock, new, loop=name == "loop")
                for key, value in got.items():
                    old = row.get(f"batch_{batch}_{key}")
                    better = min if key == "step_ms" else max
                    row[f"batch_{batch}_{key}"] = value if old is None else better(old, value)
                print(f"[bench] round {r} batch {batch} {name}: {got}", file=sys.stderr, flush=True)
    return best


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The issue's ratios, of the batches measured: by decode steps and end to end."""
    fused, loop, dense = rows["fused"], rows["loop"], rows["dense_same_active"]
    out = {}
    for kind in ("decode_tok_s", "tok_s"):
        if f"batch_32_{kind}" in fused:
            ratio = fused[f"batch_32_{kind}"] / loop[f"batch_32_{kind}"]
            out[f"fused_over_loop_batch_32_{kind}"] = round(ratio, 2)
        if f"batch_1_{kind}" in fused:
            ratio = dense[f"batch_1_{kind}"] / fused[f"batch_1_{kind}"]
            out[f"dense_over_fused_batch_1_{kind}"] = round(ratio, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=EXPERTS)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--settings",
        nargs="+",
        default=["1:cpu", "2:wall"],
        help="threads:clock pairs, clock `cpu` (the process's CPU time: one thread on a busy "
        "machine) or `wall`",
    )
    ap.add_argument("--quick", action="store_true", help="one round of 32 new tokens")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 1, 32
    import torch

    moe = moe_config(args.layers, args.experts)
    dense = dict(ATTENTION, num_hidden_layers=args.layers, intermediate_size=TOP_K * WIDTH)
    settings = {}
    with tempfile.TemporaryDirectory() as tmp:
        moe_path = make_family_checkpoint(Path(tmp) / "qwen3_moe", "qwen3_moe", **moe)
        dense_path = make_family_checkpoint(Path(tmp) / "qwen3_dense", "qwen3", **dense)
        llms = {
            "fused": load(moe_path, args.dtype),
            "fused_ops": load(moe_path, args.dtype, one_call=False),
            "loop": load(moe_path, args.dtype, one_call=False),
            "dense_same_active": load(dense_path, args.dtype),
        }
        for setting in args.settings:
            threads, clock = setting.split(":")
            torch.set_num_threads(int(threads))
            rows = race(llms, args.rounds, CLOCKS[clock], args.batches, args.new_tokens)
            settings[setting] = {"threads": int(threads), "clock": clock, "paths": rows}
            settings[setting] |= ratios(rows)
    print(json.dumps(document("moe", moe, args, settings), indent=2))


def document(
    key: str, model: dict[str, Any], args: argparse.Namespace, settings: dict[str, Any]
) -> dict[str, Any]:
    """The benchmark's JSON: the model's config under `key` (less its init), the run's
    settings and figures."""
    return {
        key: {k: v for k, v in model.items() if k != "initializer_range"},
        "dtype": args.dtype,
        "prompt_tokens": PROMPT,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "settings": settings,
    }


if __name__ == "__main__":
    main()
