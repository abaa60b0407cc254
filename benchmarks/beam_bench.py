"""Beam search benchmark, printing one JSON document.

    .venv/bin/python benchmarks/beam_bench.py [--model DIR] [--width 4] [--prompts 8]
                                              [--prompt-len 64] [--max-tokens 32] [--device cpu]

Without --model a tiny random Llama (tests/conftest.py's, fp32) is built in a temporary
directory. Measured on one engine:
1. `LLM.beam_search`: output tokens of all beams per second, the tokens the model computed
   (prompt and one per live beam and step: no recompute) and the peak KV blocks in use;
2. the same beams as `n = width` independent sequences of the same lengths (`generate`, no
   prefix caching): their peak KV blocks — what sharing saves;
3. vLLM's way (`LLM.beam_search` in vLLM issues a one-token request per beam per step with
   prefix caching): the tokens the model computes then, every beam's partly filled last block
   recomputed each step.
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

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams


def count_tokens(llm: LLM) -> list[int]:
    """Wrap the runner to count the tokens each step computes (a one-element counter)."""
    counter = [0]
    engine = llm.engine
    execute = engine._execute

    def counted(sched: Any) -> Any:
        counter[0] += sched.num_tokens
        return execute(sched)

    engine._execute = counted
    return counter


def peak(llm: LLM) -> int:
    kv = llm.engine.scheduler.kv
    value, kv.peak_used_blocks = kv.peak_used_blocks, 0
    return value


def vllm_style(llm: LLM, prompts: list[list[int]], p: BeamSearchParams) -> None:
    """vLLM's driver: every step, one request per live beam (its tokens as the prompt,
    max_tokens=1, 2 * width log-probs); blocks are shared only through the prefix cache."""
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=p.num_candidates, ignore_eos=True)
    beams = [[(list(q), 0.0)] for q in prompts]
    for _ in range(p.max_tokens):
        flat = [b for group in beams for b in group]
        outs = llm.generate([{"prompt_token_ids": t} for t, _ in flat], sp, use_tqdm=False)
        it = iter(outs)
        for g, group in enumerate(beams):
            cands = []
            for tokens, cum in group:
                lps = next(it).outputs[0].logprobs
                assert lps is not None
                cands += [([*tokens, t], cum + lp.logprob) for t, lp in lps[0].items()]
            beams[g] = sorted(cands, key=lambda c: c[1], reverse=True)[: p.beam_width]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from conftest import make_checkpoint

            model = str(make_checkpoint(Path(tmp) / "llama", "llama"))
        print(json.dumps(bench(model, args), indent=2))


def bench(model: str, args: Any) -> dict[str, Any]:
    w, steps = args.width, args.max_tokens
    knobs = dict(dtype="float32", device=args.device, block_size=args.block_size)
    llm = LLM(model, enable_prefix_caching=False, max_num_seqs=max(64, w * args.prompts), **knobs)
    vocab = llm.engine.config.model.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(2, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    params = BeamSearchParams(w, steps, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(w, 2, ignore_eos=True))
    computed = count_tokens(llm)
    peak(llm)
    start = time.perf_counter()
    llm.beam_search([{"prompt_token_ids": q} for q in prompts], params)
    elapsed = time.perf_counter() - start
    shared_blocks, shared_tokens = peak(llm), computed[0]
    indep = SamplingParams(n=w, max_tokens=steps, ignore_eos=True, seed=0)
    llm.generate([{"prompt_token_ids": q} for q in prompts], indep, use_tqdm=False)
    unshared_blocks = peak(llm)
    llm.engine.check_integrity()
    llm.close()
    vllm = LLM(model, enable_prefix_caching=True, max_num_seqs=max(64, w * args.prompts), **knobs)
    vcomputed = count_tokens(vllm)
    start = time.perf_counter()
    vllm_style(vllm, prompts, params)
    vllm_elapsed = time.perf_counter() - start
    vllm.close()
    out_tokens = args.prompts * w * steps
    return {
        "model": model,
        "device": args.device,
        "width": w,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": steps,
        "block_size": args.block_size,
        "beam_search_s": round(elapsed, 3),
        "beam_tok_per_s": round(out_tokens / elapsed, 1),
        "kv_blocks_peak_shared": shared_blocks,
        "kv_blocks_peak_unshared": unshared_blocks,
        "tokens_computed": shared_tokens,
        "tokens_computed_vllm_style": vcomputed[0],
        "vllm_style_s": round(vllm_elapsed, 3),
        "vllm_style_tok_per_s": round(out_tokens / vllm_elapsed, 1),
    }


if __name__ == "__main__":
    main()
