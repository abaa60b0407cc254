"""Embedding throughput of the pooling runner, printing JSON.

    .venv/bin/python benchmarks/embed_bench.py [--model DIR] [--batches 1,64] [--rounds 2]

SmolLM2-135M-Instruct by default (fp32, or `--quantization gguf`), prompts of 24-40 tokens
(random ids, a fixed seed). For each batch size: embeddings/s and prompt tokens/s of
`LLM(runner="pooling").embed` (LAST pooling, normalised), and of the same prompts through the
generation engine as prefill-only requests (`generate` with max_tokens=1: the scheduler, the
paged KV pool and prefix caching on; a fresh seed each round so nothing hits the cache) — the
measurement behind the pooling engine's design (docs/embeddings.md). Medians of `--rounds`
runs after a warm-up, the two engines interleaved; load average recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.prepare import prepare_smollm2


def prompts(n: int, vocab: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(24, 40))]}
        for _ in range(n)
    ]


def timed(fn: Any) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of `fn()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model = args.model or str(prepare_smollm2())
    kw: dict[str, Any] = dict(dtype="float32", quantization=args.quantization, max_num_seqs=64)
    pooling = LLM(model, runner="pooling", **kw)
    generate = LLM(model, **kw)
    vocab = pooling.pooling.config.model.vocab_size if pooling.pooling else 0
    greedy = SamplingParams(temperature=0, max_tokens=1)
    warm = prompts(2, vocab, seed=0)
    pooling.embed(warm, use_tqdm=False)
    generate.generate(warm, greedy, use_tqdm=False)
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        times: dict[str, list[tuple[float, float]]] = {"pooling": [], "generate": []}
        tokens = 0
        for r in range(args.rounds):
            ps = prompts(batch, vocab, seed=1000 * batch + r)
            tokens = sum(len(x["prompt_token_ids"]) for x in ps)
            times["pooling"].append(timed(lambda ps=ps: pooling.embed(ps, use_tqdm=False)))
            times["generate"].append(
                timed(lambda ps=ps: generate.generate(ps, greedy, use_tqdm=False))
            )
        for engine, ts in times.items():
            s = statistics.median(t[0] for t in ts)
            results.append(
                {
                    "engine": engine,
                    "batch": batch,
                    "prompt_tokens": tokens,
                    "seconds": round(s, 4),
                    "cpu_seconds": round(statistics.median(t[1] for t in ts), 4),
                    "embeddings_per_s": round(batch / s, 2),
                    "tokens_per_s": round(tokens / s, 1),
                }
            )
    print(
        json.dumps(
            {
                "model": os.path.basename(model.rstrip("/")),
                "dtype": "float32",
                "quantization": args.quantization,
                "threads": torch.get_num_threads(),
                "loadavg": os.getloadavg(),
                "rounds": args.rounds,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
