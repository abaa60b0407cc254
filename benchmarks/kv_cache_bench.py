"""KV-cache quantization on SmolLM2-135M (CPU), printing one JSON document.

    .venv/bin/python benchmarks/kv_cache_bench.py [--model DIR] [--parts ppl,agree,mix,decode]
        [--kv-dtypes auto,int8,fp8_e4m3,fp8_e5m2,fp8_e4m3:calc] [--quick]

Parts, each kv_cache_dtype beside `auto` (the model's dtype, fp32 here: fp32 activations, as
the weight-quantization rows of benchmarks/peers.py):
- ppl: perplexity of the fixed text (benchmarks/data/opticks.txt), teacher-forced in
  llama-perplexity's windows of 512 tokens, from prompt log-probs: the text the
  weight-quantization benchmark scores (peers_parts.ours.ppl), so the rows compare;
A dtype spelled `fp8_...:calc` runs with `calculate_kv_scales` (each layer's scales estimated
from the first forward, model/kv_scales.py; agree only); a plain fp8 one with scale 1.0 (SmolLM2's
checkpoint has no scales).
- agree: greedy continuations of prompts cut from the text: teacher-forced agreement (the
  unquantized engine, fed the quantized run's tokens, ranks the same token first) and, free
  running, the tokens before the first divergence from the unquantized run;
- mix: the peers benchmark's request mix under a KV memory budget where the unquantized cache
  preempts: throughput and preemptions;
- decode: the median engine step at batch 32 (context 512; --quick: 256) of a bf16 model with
  each cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from peers_parts import common
from peers_parts.common import Budget
from peers_parts.ours import ppl_of

from pagedllm import LLM, SamplingParams
from pagedllm.prepare import prepare_smollm2

MIX_KV_MEMORY = 96 << 20  # a budget where the fp32 cache preempts on the mix


def engine(model: str, kind: str, **knobs: Any) -> LLM:
    """SmolLM2 in fp32 on the CPU with this KV cache dtype."""
    return LLM(model, dtype="float32", device="cpu", kv_cache_dtype=kind, **knobs)


def ppl(model: str, kind: str, budget: Budget) -> dict[str, Any]:
    llm = engine(model, kind, max_model_len=budget.ppl_ctx + 8, enable_prefix_caching=False)
    return ppl_of(llm, budget)


def agree(model: str, kinds: list[str], prompts: int, tokens: int) -> dict[str, Any]:
    """Per cache dtype: teacher-forced agreement with the unquantized engine and the tokens
    each free-running continuation keeps before it first differs from the unquantized one."""
    ref = LLM(model, dtype="float32", device="cpu", enable_prefix_caching=False)
    text = list(ref.get_tokenizer().encode(common.text()))
    cut = [text[i * 97 : i * 97 + 64] for i in range(prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False)

    def continuations(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in cut], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    base = continuations(ref)
    res: dict[str, Any] = {"prompts": prompts, "prompt_tokens": 64, "max_tokens": tokens}
    for kind in kinds:
        if kind == "auto":
            continue
        name, _, how = kind.partition(":")
        llm = engine(model, name, calculate_kv_scales=how == "calc")
        outs = continuations(llm)
        llm.close()
        fed = ref.generate(
            [{"prompt_token_ids": p + o} for p, o in zip(cut, outs, strict=True)],
            score,
            use_tqdm=False,
        )
        same = total = 0
        for p, o, f in zip(cut, outs, fed, strict=True):
            lps = f.prompt_logprobs
            assert lps is not None
            for j, tok in enumerate(o):
                entry = lps[len(p) + j]
                assert entry is not None
                same += entry[tok].rank == 1
                total += 1
        firsts = [first_difference(o, b) for o, b in zip(outs, base, strict=True)]
        res[kind] = {
            "teacher_forced_agreement": round(same / total, 4),
            "tokens_before_divergence_median": statistics.median(firsts),
            "tokens_before_divergence_min": min(firsts),
            "identical_continuations": sum(f == tokens for f in firsts),
        }
    return res


def first_difference(a: list[int], b: list[int]) -> int:
    """Tokens before the first position where `a` and `b` differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def mix(model: str, kind: str, budget: Budget) -> dict[str, Any]:
    llm = engine(
        model,
        kind,
        kv_cache_memory=MIX_KV_MEMORY,
        max_num_seqs=budget.mix_concurrency,
        max_model_len=budget.mix_prompt[1] + budget.mix_output[1] + 16,
    )
    reqs = common.mix_requests(llm.engine.config.model.vocab_size, budget)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    return {
        "kv_cache_memory_mib": MIX_KV_MEMORY >> 20,
        "kv_token_capacity": stats.kv_token_capacity,
        "requests": len(reqs),
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "preemptions": stats.num_preemptions,
    }


def decode(model: str, kind: str, batch: int, ctx: int, steps: int) -> dict[str, Any]:
    """The median engine step with `batch` requests decoding at `ctx` tokens (bf16 model)."""
    llm = LLM(
        model,
        dtype="bfloat16",
        device="cpu",
        kv_cache_dtype=kind,
        max_num_seqs=batch,
        max_model_len=ctx + steps + 64,
        enable_prefix_caching=False,
    )
    eng = llm.engine
    vocab = eng.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 32, ignore_eos=True)
    for i, p in enumerate(common.decode_prompts(vocab, batch, ctx)):
        eng.add_request(f"d{i}", p, params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.requests.values()):
        eng.step()
    eng.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    return {"batch": batch, "context": ctx, "step_ms": round(statistics.median(times) * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--parts", default="ppl,agree,mix,decode")
    ap.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also written here after each part")
    args = ap.parse_args()
    torch.set_num_threads(common.THREADS)
    model = args.model or str(prepare_smollm2())
    kinds, parts = args.kv_dtypes.split(","), args.parts.split(",")
    budget = Budget(mix_requests=24, ppl_max_chunks=4 if args.quick else 0)
    if args.quick:
        budget = Budget(mix_requests=12, mix_output=(16, 64), ppl_max_chunks=4)
    res: dict[str, Any] = {"model": model, "threads": common.THREADS}
    steps, ctx = (8, 256) if args.quick else (24, 512)
    parts_run: dict[str, Any] = {
        "ppl": lambda: {k: ppl(model, k, budget) for k in kinds},
        "agree": lambda: agree(model, kinds, 8 if args.quick else 16, 32 if args.quick else 64),
        "mix": lambda: {k: mix(model, k, budget) for k in kinds if k in ("auto", "int8")},
        "decode": lambda: {
            k: decode(model, k, 32, ctx, steps) for k in kinds if k in ("auto", "int8")
        },
    }
    for part in parts:
        res[part] = parts_run[part]()
        if args.out:  # what is done so far, should a later part not finish
            args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
