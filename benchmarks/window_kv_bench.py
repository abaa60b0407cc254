"""KV blocks saved by freeing what falls out of the sliding window, printing one JSON document.

    .venv/bin/python benchmarks/window_kv_bench.py [--requests 16] [--prompt 64] [--new 960]
        [--window 128] [--block-size 16] [--layers 2]

A random tiny Mistral checkpoint (tests/conftest.py's, every layer windowed, fp32) serves
`--requests` greedy requests of `--prompt` random tokens and `--new` new tokens each
(ignore_eos), all at once, twice: with the out-of-window blocks freed and without
(`EngineConfig.create(free_out_of_window_blocks=...)`), and both times in

1. an ample pool (every request at full length fits): the peak of KV blocks in use, i.e. the
   memory the window saves;
2. a pool of the with-dropping peak: what that pool costs the engine that keeps every block
   (preemptions and recomputed time).

Both runs of a part must produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import make_checkpoint
from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine


def run(model: Path, prompts: list[list[int]], new: int, drop: bool, **knobs: Any) -> dict:
    config = EngineConfig.create(
        model, dtype="float32", free_out_of_window_blocks=drop, max_num_seqs=len(prompts), **knobs
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    engine.check_integrity()
    stats = engine.stats()
    assert stats.kv_blocks_used == 0
    mcfg = config.model
    block_bytes = 2 * mcfg.num_layers * config.cache.block_size * mcfg.num_kv_heads
    block_bytes *= mcfg.head_dim * config.dtype.itemsize
    engine.close()
    return {
        "pool_blocks": stats.kv_blocks_total,
        "peak_blocks": stats.kv_blocks_peak,
        "peak_kv_mib": round(stats.kv_blocks_peak * block_bytes / 2**20, 2),
        "blocks_freed_by_window": stats.kv_blocks_freed_by_window,
        "preemptions": stats.num_preemptions,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(len(prompts) * new / seconds, 1),
        "tokens": [outs[str(i)] for i in range(len(prompts))],
    }


def both(model: Path, prompts: list[list[int]], new: int, **knobs: Any) -> dict[str, Any]:
    off = run(model, prompts, new, drop=False, **knobs)
    on = run(model, prompts, new, drop=True, **knobs)
    same = off.pop("tokens") == on.pop("tokens")
    assert same, "dropping changed the tokens"
    return {
        "keep_all_blocks": off,
        "free_out_of_window": on,
        "same_tokens": same,
        "peak_blocks_saved": round(1 - on["peak_blocks"] / off["peak_blocks"], 3),
        "keep_all_time_ratio": round(off["seconds"] / on["seconds"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=960)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    length = args.prompt + args.new
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 384) for _ in range(args.prompt)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(
            Path(tmp) / "mistral",
            "mistral",
            sliding_window=args.window,
            num_hidden_layers=args.layers,
            max_position_embeddings=max(512, length),
        )
        per_request = -(-length // args.block_size)
        knobs: dict[str, Any] = dict(block_size=args.block_size, max_model_len=length)
        ample = both(model, prompts, args.new, num_kv_blocks=args.requests * per_request, **knobs)
        tight = ample["free_out_of_window"]["peak_blocks"]
        result = {
            "workload": {
                "requests": args.requests,
                "prompt_tokens": args.prompt,
                "new_tokens": args.new,
                "sliding_window": args.window,
                "block_size": args.block_size,
                "layers": args.layers,
                "blocks_per_request_at_full_length": per_request,
            },
            "ample_pool": ample,
            "pool_of_the_dropping_peak": both(
                model, prompts, args.new, num_kv_blocks=max(tight, per_request), **knobs
            ),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
