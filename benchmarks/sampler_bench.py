"""Sampler cost per step at batch 64 on SmolLM2-135M, as a fraction of the decode step,
printing one JSON document.

    .venv/bin/python benchmarks/sampler_bench.py [--model DIR] [--iters 20]

Three sampler configurations on the same (64, vocab) fp32 logits, each timed including the
per-step build of its parameter tensors: greedy (argmax fast path), all features on
(temperature, top-k, top-p, min-p, repetition/presence/frequency penalties over a 256-token
prompt and 128 outputs, min_tokens, per-request seeds on half the rows, logprobs=5), and
the decode step of the engine at batch 64 (context ~384) for reference.
"""

from __future__ import annotations

import argparse
import json
import random

import torch
from engine_bench import _time  # sibling script: benchmarks/ is on sys.path when run

from pagedllm.layers.sampler import Sampler, SampleRequest, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

BATCH = 64


def rows(kind: str, vocab: int) -> list[SampleRequest]:
    rng = random.Random(0)
    out = []
    for i in range(BATCH):
        prompt = [rng.randrange(vocab) for _ in range(256)]
        output = [rng.randrange(vocab) for _ in range(128)]
        if kind == "greedy":
            params = SamplingParams(temperature=0, max_tokens=256)
            gen = None
        else:
            params = SamplingParams(
                temperature=0.8,
                top_k=50,
                top_p=0.9,
                min_p=0.05,
                repetition_penalty=1.1,
                presence_penalty=0.5,
                frequency_penalty=0.3,
                min_tokens=200,
                max_tokens=256,
                seed=i if i % 2 else None,
                logprobs=5,
            )
            gen = torch.Generator().manual_seed(i) if i % 2 else None
        out.append(SampleRequest(params, prompt, output, gen, stop_ids=(2,)))
    return out


def sampler_ms(kind: str, vocab: int, iters: int) -> float:
    sampler = Sampler()
    batch = rows(kind, vocab)
    logits = torch.randn(BATCH, vocab) * 3

    def run() -> None:
        meta = SamplingMetadata.build(batch, vocab, torch.device("cpu"))
        sampler(logits, batch, meta)

    return _time(run, iters) * 1e3


def decode_step_ms(model: str, iters: int) -> float:
    from pagedllm import LLM

    llm = LLM(model, dtype="float32", max_num_seqs=BATCH, max_model_len=1024)
    eng = llm.engine
    rng = random.Random(1)
    vocab = eng.config.model.vocab_size
    for i in range(BATCH):
        prompt = [rng.randrange(100, vocab) for _ in range(384)]
        eng.add_request(
            str(i), prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        )
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.requests.values()):
        eng.step()
    return _time(eng.step, iters) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.model is None:
        from pagedllm.prepare import prepare_smollm2

        args.model = str(prepare_smollm2())
    from pagedllm.config import ModelConfig

    vocab = ModelConfig.from_model_dir(args.model).vocab_size
    greedy = sampler_ms("greedy", vocab, args.iters)
    full = sampler_ms("all", vocab, args.iters)
    step = decode_step_ms(args.model, max(5, args.iters // 4))
    print(
        json.dumps(
            {
                "batch": BATCH,
                "vocab": vocab,
                "sampler_ms_greedy": round(greedy, 2),
                "sampler_ms_all_features": round(full, 2),
                "decode_step_ms_fp32": round(step, 1),
                "fraction_all_features": round(full / step, 3),
                "fraction_greedy": round(greedy / step, 3),
                "target_fraction": 0.10,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
