"""pagedllm's parts: decode steps at (batch, context), the request mix, perplexity."""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch
from engine_bench import _once, peak_rss_mib

from peers_parts import common
from peers_parts.common import Budget

# precision row -> (dtype, quantization); quantized rows run with fp32 activations, as llama.cpp
PRECISIONS = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "gguf-q4_1": ("float32", "gguf"),
}


def quantization_support() -> str | None:
    """None if `LLM` takes `quantization`, else why the quantized rows are skipped."""
    from pagedllm import LLM

    if "quantization" in inspect.signature(LLM.__init__).parameters:
        return None
    return "pagedllm.LLM has no `quantization` argument in this checkout"


def make_llm(model: str, precision: str, **kwargs: Any) -> Any:
    from pagedllm import LLM

    dtype, quant = PRECISIONS[precision]
    if quant is not None:
        kwargs["quantization"] = quant
    return LLM(model, dtype=dtype, **kwargs)


def weight_bytes(llm: Any) -> int:
    """Bytes of the weights one decode step reads, as held (dense or quantized): every linear
    layer and the LM head (the embedding lookup reads one row; norms are negligible)."""
    m = llm.engine.runner.model
    names = [
        f"{name}.weight"
        for name, mod in m.named_modules()
        if isinstance(mod, torch.nn.Linear) and name != "lm_head"
    ]
    return sum(_nbytes(m.weight(n)) for n in names) + _nbytes(m._io[1])  # _io: (embed, head)


def _nbytes(w: Any) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else int(w.nbytes)


def decode(model: str, precision: str, batch: int, ctx: int, steps: int) -> dict[str, Any]:
    """Prefill `batch` random prompts of `ctx` tokens, then time `steps` engine steps with all of
    them decoding (mean step time, as llama-batched-bench's S_TG)."""
    from pagedllm import SamplingParams

    # NOTE: the prompts admitted first decode while the later ones prefill (chunks of the token
    # budget), so max_tokens leaves room for those steps: no request may finish before the end
    max_tokens = steps + batch * ctx // 512 + 8
    llm = make_llm(
        model,
        precision,
        max_num_seqs=batch,
        max_model_len=ctx + max_tokens + 16,
        enable_prefix_caching=False,
    )
    eng = llm.engine
    llm.generate(
        {"prompt_token_ids": [100, 101, 102]}, SamplingParams(max_tokens=2), use_tqdm=False
    )
    prompts = common.decode_prompts(eng.config.model.vocab_size, batch, ctx)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"d{i}", p, params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.requests.values()):
        eng.step()  # prefill (each prompt's last chunk also samples its first token)
    prefill = time.perf_counter() - start
    eng.step()
    total = sum(_once(eng.step) for _ in range(steps))
    assert eng.scheduler.num_running == batch, f"{eng.scheduler.num_running} running, not {batch}"
    step = total / steps
    out = {
        "batch": batch,
        "context_tokens": ctx,
        "prefill_tokens_per_s": round(batch * ctx / prefill, 1),
        "step_ms": round(step * 1e3, 2),
        "tokens_per_s": round(batch / step, 1),
    }
    if batch == 1:
        out["weight_bytes"] = weight_bytes(llm)
    return out


def mix(model: str, precision: str, budget: Budget) -> dict[str, Any]:
    from pagedllm import SamplingParams

    llm = make_llm(
        model,
        precision,
        max_num_seqs=budget.mix_concurrency,
        max_model_len=budget.mix_prompt[1] + budget.mix_output[1] + 16,
    )
    reqs = common.mix_requests(llm.engine.config.model.vocab_size, budget)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    warm = [{"prompt_token_ids": [100 + i] * 8} for i in range(2)]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(m for _, m in reqs), f"{n_out} tokens, not {sum(m for _, m in reqs)}"
    ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics is not None]
    assert len(ttfts) == len(outs) and all(t is not None for t in ttfts), "a TTFT is missing"
    done = [float(t) for t in ttfts if t is not None]
    return common.mix_result(len(reqs), budget.mix_concurrency, elapsed, n_out, done)


def ppl(model: str, precision: str, budget: Budget) -> dict[str, Any]:
    """Perplexity over the fixed text from prompt log-probs, in llama-perplexity's windows."""
    llm = make_llm(model, precision, max_model_len=budget.ppl_ctx + 8, enable_prefix_caching=False)
    return ppl_of(llm, budget)


def ppl_of(llm: Any, budget: Budget) -> dict[str, Any]:
    """`llm`'s perplexity of the fixed text (prefix caching off: every window computed)."""
    from pagedllm import SamplingParams

    tokens = llm.get_tokenizer().encode(common.text())
    tokens = list(getattr(tokens, "ids", tokens))
    chunks = common.ppl_chunks(tokens, budget)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    nlls = []
    for chunk, out in zip(chunks, outs, strict=True):
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(chunk)
        for j in common.ppl_scored(len(chunk)):
            entry = lps[j]
            assert entry is not None
            nlls.append(-entry[chunk[j]].logprob)
    return common.ppl_result(tokens, budget, len(chunks), nlls)


def run_all(model: str, precision: str, budget_d: dict[str, Any]) -> dict[str, Any]:
    """Every part for one precision, in this (fresh) process, strictly one after another."""
    torch.set_num_threads(common.THREADS)
    torch.manual_seed(0)
    budget = Budget.from_dict(budget_d)
    res: dict[str, Any] = {"decode": []}
    for batch, ctx in budget.decode_configs:
        res["decode"].append(
            common.with_load(
                decode,
                model,
                precision,
                batch,
                ctx,
                budget.decode_steps,
                batch=batch,
                context_tokens=ctx,
            )
        )
    res["mix"] = common.with_load(mix, model, precision, budget)
    if precision != "bf16":
        res["perplexity"] = common.with_load(ppl, model, precision, budget)
    res["peak_rss_mib"] = round(peak_rss_mib())
    return res
