"""N-gram speculative decoding on SmolLM2-135M-Instruct, printing one JSON document.

    .venv/bin/python benchmarks/spec_bench.py [--quantization gguf] [--batches 1,8,32]
        [--max-tokens 128] [--k 4] [--output FILE]

For each task kind (input-grounded: rewrite / edit / extract from a given text, whose answer
copies the prompt; free-form chat) and batch size: decode tokens per second (output tokens /
wall time of `LLM.generate`, prompts included, greedy, the model's own stops) without and with
`speculative_config={"method": "ngram", ...}`, the speed-up, whether the outputs were the
same, and the drafts' acceptance per position. Batch 1 runs each prompt on its own; batch B
runs B prompts at once (the task's prompts repeated). Both engines are built once and run
interleaved, task by task, so that a drifting machine hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

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


def chat(tokenizer: Any, text: str) -> list[int]:
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer.encode(prompt))


def run(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams) -> dict[str, Any]:
    """Output tokens and seconds of `prompts`, `batch` at a time."""
    spec = llm.engine.scheduler.spec
    before = spec.counters() if spec is not None else None
    tokens, seconds, outs = 0, 0.0, []
    for i in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        start = time.perf_counter()
        res = llm.generate(group, params, use_tqdm=False)  # type: ignore[arg-type]
        seconds += time.perf_counter() - start
        tokens += sum(len(r.outputs[0].token_ids) for r in res)
        outs += [r.outputs[0].token_ids for r in res]
    result: dict[str, Any] = {"tokens": tokens, "seconds": round(seconds, 3), "outputs": outs}
    if spec is not None and before is not None:
        drafts, drafted, accepted, per_pos = (
            a - b if isinstance(a, int) else tuple(x - y for x, y in zip(a, b, strict=True))
            for a, b in zip(spec.counters(), before, strict=True)
        )
        assert isinstance(per_pos, tuple)
        result["drafts"] = drafts
        result["acceptance"] = round(accepted / drafted, 3) if drafted else None
        result["acceptance_per_pos"] = [round(n / drafts, 3) if drafts else None for n in per_pos]
        result["mean_accepted_per_draft"] = round(accepted / drafts, 3) if drafts else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quantization", default="gguf", help="default gguf (the served default)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    model = str(prepare_smollm2())
    spec_cfg = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
        "max_batch_size": 1024,  # measured at every batch size: no back-off by batch
    }
    common = dict(quantization=args.quantization, max_model_len=1024, max_num_seqs=64)
    plain = LLM(model, **common)  # type: ignore[arg-type]
    spec = LLM(model, speculative_config=spec_cfg, **common)  # type: ignore[arg-type]
    tok = plain.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tasks = {"grounded": [chat(tok, t) for t in GROUNDED], "chat": [chat(tok, t) for t in CHAT]}
    warm = [tasks["chat"][0][:16]]
    for llm in (plain, spec):
        run(llm, warm, 1, SamplingParams(temperature=0, max_tokens=8))
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for kind, prompts in tasks.items():
            todo = prompts if batch == 1 else (prompts * -(-batch // len(prompts)))[:batch]
            base = run(plain, todo, batch, params)
            fast = run(spec, todo, batch, params)
            entry = {
                "task": kind,
                "batch": batch,
                "tok_s": round(base["tokens"] / base["seconds"], 2),
                "tok_s_ngram": round(fast["tokens"] / fast["seconds"], 2),
                "speedup": round(
                    (fast["tokens"] / fast["seconds"]) / (base["tokens"] / base["seconds"]), 3
                ),
                "same_outputs": base["outputs"] == fast["outputs"],
                **{k: v for k, v in fast.items() if k not in ("outputs", "tokens", "seconds")},
                "tokens": base["tokens"],
            }
            print(json.dumps(entry), file=sys.stderr, flush=True)
            results.append(entry)
    doc = {
        "model": "SmolLM2-135M-Instruct",
        "quantization": args.quantization,
        "speculative_config": spec_cfg,
        "max_tokens": args.max_tokens,
        "threads": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
    }
    text = json.dumps(doc, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
