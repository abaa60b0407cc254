"""N-gram speculative decoding on SmolLM2-135M-Instruct, printing one JSON document.

    .venv/bin/python benchmarks/spec_bench.py [--quick] [--quantization none|gguf]
        [--batches 1,2,4,8,16,32] [--max-tokens 64] [--rounds 2] [--k 4] [--threads N]
        [--output FILE]

For each batch size and task kind (input-grounded: rewrite / edit / extract from a given text,
whose answer copies the prompt; free-form chat): decode tokens per second (the tokens emitted
after every request of the batch has its first one, over the wall time of those steps: the
prefill is left out) of three engines — without speculation (`plain`), with n-gram
speculation drafting at every batch size (`ngram`: `max_batch_size` 1024, so its cost is
measured where the default backs off) and with the default back-off (`auto`); the speed-ups
over `plain`, whether the greedy outputs were the same, and the drafts' acceptance per
position. Batch 1 runs the task's prompts one at a time; batch B runs them B at once,
repeated until every prompt has run equally often (lcm(B, prompts) requests: each batch size
measures the same prompts, so a speed-up at one batch compares with another's). The engines are built once and take turns within each (batch, task), over
`--rounds` rounds, group by group in rotating order, so that a drifting machine hits them
alike (on a loaded machine add `--threads 1`: threads that wait for each other stall a step).

`crossover`: per task, the largest measured batch up to which `ngram` pays (speed-up >= 1 at
it and every smaller one) and the next measured batch (where it stopped paying); the default
`max_batch_size` (`pagedllm.spec_config`) is set from it. `--quick`: batches 1, 8 and 32 (or
`--batches`), 32 new tokens, one round (under 3 minutes on a quiet 2-vCPU machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.prepare import prepare_smollm2

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
"""
TEXT = (
    "The Rhine is a river that begins in the Swiss Alps, forms part of the Swiss-Austrian, "
    "Swiss-Liechtenstein, Swiss-German and then the Franco-German border, then flows through "
    "the German Rhineland and the Netherlands and eventually empties into the North Sea. It "
    "is about 1,230 kilometres long. The largest city on the river is Cologne, Germany, with "
    "a population of more than 1,050,000 people."
)
GROUNDED = [
    f"Rename the function `mean` to `average` everywhere in this code:\n\n{CODE}",
    f"Add a docstring to each function of this code and return the whole code:\n\n{CODE}",
    f"Repeat the following paragraph, replacing 'river' with 'stream':\n\n{TEXT}",
    f"Copy the sentences of this text that contain a number:\n\n{TEXT}",
]
CHAT = [
    "Tell me a short story about a robot who learns to paint.",
    "What are three benefits of regular exercise?",
    "Explain how a rainbow forms.",
    "Write a haiku about the sea, then explain it.",
]
_ids = itertools.count()


def chat(tokenizer: Any, text: str) -> list[int]:
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer.encode(prompt))


def decode(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float, list]:
    """Run `prompts` together: (tokens emitted once every request had its first token,
    seconds those steps took, each request's output ids)."""
    engine = llm.engine
    rids = [f"b{next(_ids)}" for _ in prompts]
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(rid, p, params)
    lengths = dict.fromkeys(rids, 0)
    outputs: dict[str, list[int]] = {}
    start, at_start = 0.0, 0
    while engine.has_unfinished_requests():
        if not start and all(lengths.values()):  # the decode phase begins
            start, at_start = time.perf_counter(), sum(lengths.values())
        for out in engine.step():
            ids = list(out.outputs[0].token_ids)
            lengths[out.request_id] = len(ids)
            if out.finished:
                outputs[out.request_id] = ids
    seconds = time.perf_counter() - start if start else 0.0
    return sum(lengths.values()) - at_start, seconds, [outputs[r] for r in rids]


def counters(llm: LLM) -> tuple[int, int, int, tuple[int, ...]]:
    spec = llm.engine.scheduler.spec
    return spec.counters() if spec is not None else (0, 0, 0, ())


def measure(
    engines: dict[str, LLM],
    prompts: list[list[int]],
    batch: int,
    params: SamplingParams,
    rounds: int,
) -> dict[str, Any]:
    """The engines in turns over `rounds` rounds: tok/s each, outputs of the first round, and
    the `ngram` engine's drafts over all rounds."""
    names = list(engines)
    tokens, seconds, outs = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0), {}
    before = counters(engines["ngram"])
    turn = 0
    for _ in range(rounds):
        got: dict[str, list] = {name: [] for name in names}
        for i in range(0, len(prompts), batch):  # each group by every engine in turn
            turn += 1
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                n, s, o = decode(engines[name], prompts[i : i + batch], params)
                tokens[name] += n
                seconds[name] += s
                got[name] += o
        for name in names:
            outs.setdefault(name, got[name])
    drafts, drafted, accepted, per_pos = (
        a - b if isinstance(a, int) else tuple(x - y for x, y in zip(a, b, strict=True))
        for a, b in zip(counters(engines["ngram"]), before, strict=True)
    )
    assert isinstance(drafts, int) and isinstance(drafted, int) and isinstance(accepted, int)
    assert isinstance(per_pos, tuple)
    rate = {name: tokens[name] / seconds[name] for name in names}
    return {
        "tok_s": {name: round(rate[name], 2) for name in names},
        "speedup": {name: round(rate[name] / rate["plain"], 3) for name in names[1:]},
        "same_outputs": all(outs[name] == outs["plain"] for name in names),
        "decode_tokens": tokens["plain"],
        "drafts": drafts,
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "acceptance_per_pos": [round(n / drafts, 3) if drafts else None for n in per_pos],
        "mean_accepted_per_draft": round(accepted / drafts, 3) if drafts else None,
    }


def crossover(results: list[dict[str, Any]], task: str) -> dict[str, int | None]:
    """The largest batch up to which `ngram` paid at every measured batch, and the next one."""
    paying, losing = None, None
    for r in sorted((r for r in results if r["task"] == task), key=lambda r: r["batch"]):
        if r["speedup"]["ngram"] < 1.0:
            losing = r["batch"]
            break
        paying = r["batch"]
    return {"last_paying": paying, "first_losing": losing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="batches 1,8,32, 32 tokens, 1 round")
    ap.add_argument("--quantization", default="none", help="none (fp32) or gguf (Q4_1)")
    ap.add_argument("--batches", default=None, help="default 1,2,4,8,16,32 (--quick: 1,8,32)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.threads:  # e.g. 1 on a loaded machine, where waiting threads stall each step
        torch.set_num_threads(args.threads)
    if args.quick:
        args.max_tokens, args.rounds = 32, 1
    args.batches = args.batches or ("1,8,32" if args.quick else "1,2,4,8,16,32")
    model = str(prepare_smollm2())
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    common: dict[str, Any] = dict(
        quantization=args.quantization,
        max_model_len=1024,
        max_num_seqs=64,
        kv_cache_memory=400 << 20,  # 32 requests of ~250 tokens (fp32), three engines at once
    )
    engines = {
        "plain": LLM(model, **common),
        "ngram": LLM(model, speculative_config={**ngram, "max_batch_size": 1024}, **common),
        "auto": LLM(model, speculative_config=ngram, **common),
    }
    tok = engines["plain"].get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tasks = {"grounded": [chat(tok, t) for t in GROUNDED], "chat": [chat(tok, t) for t in CHAT]}
    for llm in engines.values():  # warm-up: every code path once
        decode(llm, tasks["grounded"][:2], SamplingParams(temperature=0, max_tokens=8))
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for kind, prompts in tasks.items():
            todo = prompts * (math.lcm(batch, len(prompts)) // len(prompts))
            entry = {
                "task": kind,
                "batch": batch,
                **measure(engines, todo, batch, params, args.rounds),
            }
            print(json.dumps(entry), file=sys.stderr, flush=True)
            results.append(entry)
    doc = {
        "model": "SmolLM2-135M-Instruct",
        "quantization": args.quantization,
        "speculative_config": ngram,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
        "crossover": {task: crossover(results, task) for task in tasks},
    }
    text = json.dumps(doc, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
