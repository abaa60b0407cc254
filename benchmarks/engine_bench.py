"""Engine benchmark on SmolLM2-135M (fp32 and bf16), printing one JSON document.

    .venv/bin/python benchmarks/engine_bench.py [--model DIR] [--dtypes float32,bfloat16] [--quick]

Measured, per dtype, each part in a fresh child process (so peak memory is its own):
1. offline throughput of 64 requests (prompts 32-512 tokens, outputs 16-256 tokens,
   ignore_eos) through `LLM.generate`, vs HF transformers `generate` on the same requests in
   static left-padded batches of 32;
2. decode step time at batch 1 and 32 vs the model's bare linear-layer chain at the same batch
   size (the same weights' matmuls, nothing else: the practical ceiling);
3. peak resident memory of the engine process, and TTFT of a 1k-token prompt without and
   with a prefix-cache hit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

NUM_REQUESTS = 64
HF_BATCH = 32


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def workload(vocab: int, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- parts, each run in its own process ------------------------------------------------------


def engine_throughput(model: str, dtype: str, n: int) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=64, max_model_len=1024)
    reqs = workload(llm.engine.config.model.vocab_size, n)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_out == sum(m for _, m in reqs)
    return {
        "seconds": round(elapsed, 2),
        "output_tokens": num_out,
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "preemptions": llm.engine.stats().num_preemptions,
        "peak_rss_mib": round(peak_rss_mib()),
    }


def hf_throughput(model: str, dtype: str, n: int) -> dict[str, Any]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    reqs = workload(hf.config.vocab_size, n)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def run_batch(batch: list[tuple[list[int], int]]) -> int:
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        max_new = max(m for _, m in batch)
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
        assert out.shape[1] == width + max_new
        # a static batch runs until its longest request is done; the useful tokens are each
        # request's own max_tokens
        return sum(m for _, m in batch)

    run_batch(reqs[:2])  # warm-up
    start = time.perf_counter()
    useful = sum(run_batch(reqs[i : i + HF_BATCH]) for i in range(0, len(reqs), HF_BATCH))
    elapsed = time.perf_counter() - start
    return {
        "seconds": round(elapsed, 2),
        "output_tokens": useful,
        "output_tokens_per_s": round(useful / elapsed, 1),
        "batch_size": HF_BATCH,
        "peak_rss_mib": round(peak_rss_mib()),
    }


def _once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_vs_linear_chain(model: str, dtype: str, batch: int, ctx: int, iters: int) -> dict:
    """Median decode step (engine.step, all `batch` requests decoding at context ~`ctx`) vs the
    median time of the same model's linear layers alone on a (batch, hidden) input, the two
    measured alternately."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        max_num_seqs=max(batch, 1),
        max_model_len=2048,
        enable_prefix_caching=False,
    )
    eng = llm.engine
    rng = random.Random(batch)
    vocab = eng.config.model.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(ctx)]
        eng.add_request(
            str(i),
            prompt,
            SamplingParams(temperature=0, max_tokens=iters * 3 + 10, ignore_eos=True),
        )
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.requests.values()):
        eng.step()  # prefill everything
    eng.step()

    m = eng.runner.model
    linears = [
        lin
        for layer in m.decoder_layers()
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    cfg = eng.config.model
    x = {
        lin.in_features: torch.randn(batch, lin.in_features, dtype=eng.config.dtype)
        for lin in linears
    }

    @torch.inference_mode()
    def chain() -> None:
        for lin in linears:
            lin(x[lin.in_features])
        m.lm_head(x[cfg.hidden_size])

    # alternated, one of each at a time, so that the machine's speed drifting (it does, by
    # +-15 % over seconds) affects both alike; medians of `iters` samples each
    chain()
    steps, chains = [], []
    for _ in range(iters):
        steps.append(_once(eng.step))
        chains.append(_once(chain))
    assert eng.scheduler.num_running == batch
    step, ceiling = statistics.median(steps), statistics.median(chains)
    return {
        "batch": batch,
        "context_tokens": ctx,
        "step_ms": round(step * 1e3, 2),
        "linear_chain_ms": round(ceiling * 1e3, 2),
        "fraction_of_ceiling": round(ceiling / step, 3),
        "tokens_per_s": round(batch / step, 1),
    }


def ttft(model: str, dtype: str) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=2048)
    eng = llm.engine
    rng = random.Random(7)
    prompt = [rng.randrange(100, eng.config.model.vocab_size) for _ in range(1024)]
    warm = [rng.randrange(100, eng.config.model.vocab_size) for _ in range(64)]
    llm.generate(
        {"prompt_token_ids": warm}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )

    def first_token(request_id: str) -> float:
        start = time.perf_counter()
        eng.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
        while not eng.step():
            pass
        return time.perf_counter() - start

    cold = first_token("cold")
    hit = first_token("hit")
    return {
        "prompt_tokens": len(prompt),
        "ttft_ms_no_cache": round(cold * 1e3, 1),
        "ttft_ms_prefix_hit": round(hit * 1e3, 1),
        "prefix_hit_tokens": eng.stats().prefix_cache_hits,
        "peak_rss_mib": round(peak_rss_mib()),
    }


def _child(fn_name: str, args: tuple, queue: mp.Queue) -> None:
    torch.manual_seed(0)
    queue.put(globals()[fn_name](*args))


def isolated(fn_name: str, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn_name, args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: prepared SmolLM2)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quick", action="store_true", help="16 requests, fewer iterations")
    args = ap.parse_args()
    if args.model is None:
        from pagedllm.prepare import prepare_smollm2

        args.model = str(prepare_smollm2())
    n = 16 if args.quick else NUM_REQUESTS
    iters = 5 if args.quick else 20
    report: dict[str, Any] = {
        "model": args.model,
        "machine": {"threads": torch.get_num_threads(), "torch": torch.__version__},
        "num_requests": n,
        "results": {},
    }
    for dtype in args.dtypes.split(","):
        res: dict[str, Any] = {}
        log(f"{dtype}: engine throughput")
        res["engine"] = isolated("engine_throughput", args.model, dtype, n)
        log(f"{dtype}: HF transformers throughput")
        res["hf_transformers"] = isolated("hf_throughput", args.model, dtype, n)
        res["speedup_vs_hf"] = round(
            res["engine"]["output_tokens_per_s"] / res["hf_transformers"]["output_tokens_per_s"], 2
        )
        res["decode"] = []
        for batch in (1, 32):
            log(f"{dtype}: decode step at batch {batch}")
            res["decode"].append(
                isolated("decode_vs_linear_chain", args.model, dtype, batch, 128, iters)
            )
        log(f"{dtype}: TTFT")
        res["ttft"] = isolated("ttft", args.model, dtype)
        report["results"][dtype] = res
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
