"""Cost of log-probs on decode throughput (issue: logprobs=5 on every request of a batch of 32
costs at most 25 %; not asking costs nothing). Prints one JSON document.

    .venv/bin/python benchmarks/logprobs_bench.py [--model DIR] [--output FILE] [--modes none,0,5,20]

One `LLMEngine` per mode on SmolLM2-135M (float32) — no log-probs, then logprobs=0, 5 and 20 on
every request — each decoding `--batch` greedy requests on the same random prompts. The
engines step in turn, one step each at a time, so that the machine's drift and whatever else
runs on it hit every mode alike; each step is one token of every request, with the engine's
output processing (log-prob dicts and each top token's text, as `LLM.generate` returns them).
A mode's figure is its median step over `--steps`. Also reported: `token_logprobs` alone on
(batch, vocab) logits.
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

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

TARGET_N5 = 0.25  # the largest slowdown allowed for logprobs=5


def mode_params(mode: str, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=None if mode == "none" else int(mode),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def decoding_engine(
    config: EngineConfig, prompts: list[list[int]], mode: str, steps: int
) -> LLMEngine:
    """An engine with every request prefilled and decoding, `steps` tokens left (and a few)."""
    engine = LLMEngine(config, metrics=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, mode_params(mode, steps + 4))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()
    return engine


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def sampler_logprobs_ms(batch: int, vocab: int, num_top: int, iters: int = 20) -> float:
    from pagedllm.layers.sampler import token_logprobs

    logits = torch.randn(batch, vocab) * 3
    ids = logits.argmax(dim=-1)
    token_logprobs(logits, ids, num_top)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        token_logprobs(logits, ids, num_top)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--modes", default="none,0,5,20")
    ap.add_argument("--output", default=None, help="also write the JSON there")
    args = ap.parse_args()
    if args.model is None:
        from pagedllm.prepare import prepare_smollm2

        args.model = str(prepare_smollm2())
    modes = args.modes.split(",")
    config = EngineConfig.create(
        args.model,
        dtype="float32",
        max_num_seqs=args.batch,
        max_model_len=1024,
        kv_cache_memory=256 << 20,  # one engine per mode: a small pool each
    )
    vocab = config.model.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)
    ]
    engines = {m: decoding_engine(config, prompts, m, args.steps) for m in modes}
    load_before = os.getloadavg()[0]
    steps: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.steps):
        for mode, engine in engines.items():
            steps[mode].append(timed_step(engine))
    assert all(e.scheduler.num_running == args.batch for e in engines.values())
    median_ms = {m: statistics.median(v) * 1e3 for m, v in steps.items()}
    tokens_per_s = {m: args.batch / (ms / 1e3) for m, ms in median_ms.items()}
    out: dict[str, Any] = {
        "model_dir": args.model,
        "dtype": "float32",
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "timed_steps_per_mode": args.steps,
        "torch_threads": torch.get_num_threads(),
        "median_step_ms": {m: round(v, 2) for m, v in median_ms.items()},
        "decode_tokens_per_s": {m: round(v, 1) for m, v in tokens_per_s.items()},
        "step_ms_spread": {
            m: [round(min(v) * 1e3, 1), round(max(v) * 1e3, 1)] for m, v in steps.items()
        },
        # other processes on the machine (1-minute load average) around the timed steps
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if "none" in modes:
        base = tokens_per_s["none"]
        out["slowdown_vs_none"] = {
            f"logprobs={m}": round(1 - tokens_per_s[m] / base, 4) for m in modes if m != "none"
        }
        # the same from each rotation's pair of steps (taken within a second of each other)
        out["slowdown_vs_none_fastest_steps"] = {
            f"logprobs={m}": round(1 - min(steps["none"]) / min(steps[m]), 4)
            for m in modes
            if m != "none"
        }
        out["paired_slowdown_vs_none"] = {
            f"logprobs={m}": round(
                statistics.median(1 - a / b for a, b in zip(steps["none"], steps[m], strict=True)),
                4,
            )
            for m in modes
            if m != "none"
        }
    if "5" in modes and "none" in modes:
        out["target_slowdown_logprobs_5"] = TARGET_N5
        out["target_met"] = out["slowdown_vs_none"]["logprobs=5"] <= TARGET_N5
    out["token_logprobs_ms"] = {
        f"logprobs={n}": round(sampler_logprobs_ms(args.batch, vocab, n), 3) for n in (0, 5, 20)
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
