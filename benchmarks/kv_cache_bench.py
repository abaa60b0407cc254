"""KV-cache quantization on SmolLM2-135M (CPU), printing one JSON document.

    .venv/bin/python benchmarks/kv_cache_bench.py [--model DIR] [--parts ppl,agree,mix,steps]
        [--kv-dtypes auto,int8,fp8_e4m3,fp8_e5m2,fp8_e4m3:calc] [--quick] [--llamacpp]

Parts, each kv_cache_dtype beside `auto` (the model's dtype, fp32 here: fp32 activations, as
the weight-quantization rows of benchmarks/peers.py):
- ppl: perplexity of the fixed text (benchmarks/data/opticks.txt), teacher-forced in
  llama-perplexity's windows of 512 tokens, from prompt log-probs: the text the
  weight-quantization benchmark scores (peers_parts.ours.ppl), so the rows compare; with
  --llamacpp, llama-perplexity on the same text and weights with its f16 and q8_0
  (`-ctk q8_0 -ctv q8_0`) KV caches beside them (llama.cpp built once, peers_parts/install.py);
A dtype spelled `fp8_...:calc` runs with `calculate_kv_scales` (each layer's scales estimated
from the first forward, model/kv_scales.py; agree only); a plain fp8 one with scale 1.0 (SmolLM2's
checkpoint has no scales).
- agree: greedy continuations (32 tokens) of 64 prompts (--quick: 32) of 64 tokens cut from
  the text: teacher-forced agreement (the
  unquantized engine, fed the quantized run's tokens, ranks the same token first) and, free
  running, the tokens before the first divergence from the unquantized run;
- mix: the peers benchmark's request mix under a KV memory budget where the unquantized cache
  preempts: throughput and preemptions;
- steps: a bf16 model's engine steps with each cache at batch 32, interleaved: the prefill of
  32 prompts of 512 tokens (--quick: 128; median of 3 rounds, --quick 2) and the decode steps
  after it (median of 16, --quick 6).
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


# llama.cpp's KV cache types beside ours: its default (f16) and q8_0 (blocks of 32 int8 values
# and an f16 scale), both with flash attention (which a quantized V cache requires)
LLAMACPP_KV = {"f16": ("-fa", "on"), "q8_0": ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0")}


def llamacpp_ppl(budget: Budget) -> dict[str, Any]:
    """llama-perplexity of the same text on the same weights (the shipped GGUF requantized to
    F32: our fp32 checkpoint is that file dequantized), with each of its KV cache types;
    llama.cpp is built into a venv of its own on first use (peers_parts/install.py)."""
    from peers_parts import install, llamacpp

    from pagedllm.prepare import find_gguf

    bins = install.ensure_llama_cpp()
    gguf = llamacpp.gguf_for("fp32", bins, find_gguf())
    return {
        kind: {"gguf": gguf.name, **llamacpp.perplexity(bins, gguf, budget, flags)}
        for kind, flags in LLAMACPP_KV.items()
    }


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


def steps(
    model: str, kinds: list[str], batch: int, ctx: int, rounds: int, decode_steps: int
) -> dict[str, Any]:
    """Engine step times of a bf16 model with each cache, `batch` requests of `ctx` prompt
    tokens: the prefill steps (chunks of max_num_batched_tokens = 2048) and then
    `decode_steps` decode steps at that context. The engines run interleaved, one step each in turn, so that the
    machine's load falls on both alike; medians over `rounds` repeats of the whole prefill."""
    engines = {
        k: LLM(
            model,
            dtype="bfloat16",
            device="cpu",
            kv_cache_dtype=k,
            max_num_seqs=batch,
            max_model_len=ctx + decode_steps + 64,
            enable_prefix_caching=False,
        ).engine
        for k in kinds
    }
    vocab = next(iter(engines.values())).config.model.vocab_size
    prompts = common.decode_prompts(vocab, batch, ctx)
    prefill: dict[str, list[float]] = {k: [] for k in kinds}
    decode: dict[str, list[float]] = {k: [] for k in kinds}

    def timed_step(kind: str) -> float:
        start = time.perf_counter()
        engines[kind].step()
        return time.perf_counter() - start

    for r in range(rounds):
        last = r == rounds - 1  # the last round's requests stay for the decode steps
        params = SamplingParams(
            temperature=0, max_tokens=decode_steps + 8 if last else 1, ignore_eos=True
        )
        for eng in engines.values():
            for i, p in enumerate(prompts):
                eng.add_request(f"r{r}-{i}", p, params)
        totals = dict.fromkeys(kinds, 0.0)
        while engines[kinds[0]].has_unfinished_requests() and not (last and decoding(engines)):
            for k in kinds:
                totals[k] += timed_step(k)
        for k in kinds:
            prefill[k].append(totals[k])
    for _ in range(decode_steps):
        for k in kinds:
            decode[k].append(timed_step(k))
    return {
        "batch": batch,
        "context": ctx,
        "prefill_rounds": rounds,
        "decode_steps": decode_steps,
        **{
            k: {
                "prefill_s": round(statistics.median(prefill[k]), 3),
                "prefill_tokens_per_s": round(batch * ctx / statistics.median(prefill[k]), 1),
                "decode_step_ms": round(statistics.median(decode[k]) * 1e3, 2),
            }
            for k in kinds
        },
    }


def decoding(engines: dict[str, Any]) -> bool:
    """Every request of every engine has its prompt in the cache."""
    return all(
        r.num_computed_tokens >= r.num_tokens - 1
        for eng in engines.values()
        for r in eng.scheduler.requests.values()
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--parts", default="ppl,agree,mix,steps")
    ap.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--llamacpp",
        action="store_true",
        help="ppl: llama.cpp's f16 and q8_0 KV caches beside ours (builds llama.cpp once)",
    )
    ap.add_argument("--out", type=Path, default=None, help="also written here after each part")
    args = ap.parse_args()
    torch.set_num_threads(common.THREADS)
    model = args.model or str(prepare_smollm2())
    kinds, parts = args.kv_dtypes.split(","), args.parts.split(",")
    budget = Budget(mix_requests=24, ppl_max_chunks=4 if args.quick else 0)
    if args.quick:
        budget = Budget(mix_requests=12, mix_output=(16, 64), ppl_max_chunks=4)
    res: dict[str, Any] = {"model": model, "threads": common.THREADS}
    rounds, ctx, decode_steps = (2, 128, 6) if args.quick else (3, 512, 16)
    parts_run: dict[str, Any] = {
        "ppl": lambda: {
            **{k: ppl(model, k, budget) for k in kinds},
            **({"llama.cpp": llamacpp_ppl(budget)} if args.llamacpp else {}),
        },
        "agree": lambda: agree(model, kinds, 32 if args.quick else 64, 32),
        "mix": lambda: {k: mix(model, k, budget) for k in kinds if k in ("auto", "int8")},
        "steps": lambda: steps(
            model, [k for k in kinds if k in ("auto", "int8")], 32, ctx, rounds, decode_steps
        ),
    }
    for part in parts:
        res[part] = parts_run[part]()
        if args.out:  # what is done so far, should a later part not finish
            args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
