"""HF transformers' parts: decode steps by hand over its KV cache, the mix as `generate` on
static left-padded batches, perplexity by one forward per window."""

from __future__ import annotations

import time
from typing import Any

import torch
from engine_bench import peak_rss_mib

from peers_parts import common
from peers_parts.common import Budget

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load(model: str, precision: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=DTYPES[precision], attn_implementation="sdpa"
    ).eval()


def weight_bytes(hf: Any) -> int:
    """Every parameter once (a tied embedding is read as the LM head)."""
    return sum(p.numel() * p.element_size() for p in hf.parameters())


@torch.inference_mode()
def decode(hf: Any, batch: int, ctx: int, steps: int) -> dict[str, Any]:
    """One forward over the prompts (prefill), then `steps` single-token forwards, greedy."""
    hf(input_ids=torch.tensor([[100, 101, 102]]), logits_to_keep=1)  # warm-up
    ids = torch.tensor(common.decode_prompts(hf.config.vocab_size, batch, ctx))
    start = time.perf_counter()
    out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    prefill = time.perf_counter() - start
    past = out.past_key_values
    start = time.perf_counter()
    for _ in range(steps):
        out = hf(input_ids=tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    step = (time.perf_counter() - start) / steps
    res = {
        "batch": batch,
        "context_tokens": ctx,
        "prefill_tokens_per_s": round(batch * ctx / prefill, 1),
        "step_ms": round(step * 1e3, 2),
        "tokens_per_s": round(batch / step, 1),
    }
    if batch == 1:
        res["weight_bytes"] = weight_bytes(hf)
    return res


class _FirstToken:
    """A logits processor that notes when the batch's first token is chosen."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def mix(hf: Any, budget: Budget) -> dict[str, Any]:
    """The mix in arrival order, static batches of `mix_concurrency`; every request arrived at
    the start, so a later batch's TTFT includes the batches before it."""
    from transformers import LogitsProcessorList

    reqs = common.mix_requests(hf.config.vocab_size, budget)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    bs = budget.mix_concurrency

    def run_batch(batch: list[tuple[list[int], int]], first: _FirstToken) -> None:
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
                logits_processor=LogitsProcessorList([first]),
            )
        assert out.shape[1] == width + max_new

    run_batch(reqs[:2], _FirstToken())  # warm-up
    ttfts: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(reqs), bs):
        first = _FirstToken()
        run_batch(reqs[i : i + bs], first)
        assert first.at is not None
        ttfts += [first.at - start] * len(reqs[i : i + bs])
    elapsed = time.perf_counter() - start
    # a static batch runs until its longest request is done; the useful tokens are each
    # request's own max_tokens
    useful = sum(m for _, m in reqs)
    return common.mix_result(len(reqs), bs, elapsed, useful, ttfts)


@torch.inference_mode()
def ppl(hf: Any, model: str, budget: Budget) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(f"{model}/tokenizer.json").encode(common.text()).ids
    chunks = common.ppl_chunks(tokens, budget)
    nlls: list[float] = []
    for chunk in chunks:
        logits = hf(input_ids=torch.tensor([chunk])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        nlls += [-lp[j - 1, chunk[j]].item() for j in common.ppl_scored(len(chunk))]
    return common.ppl_result(tokens, budget, len(chunks), nlls)


def run_all(model: str, precision: str, budget_d: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(common.THREADS)
    torch.manual_seed(0)
    budget = Budget.from_dict(budget_d)
    hf = load(model, precision)
    res: dict[str, Any] = {"decode": []}
    for batch, ctx in budget.decode_configs:
        res["decode"].append(
            common.with_load(
                decode, hf, batch, ctx, budget.decode_steps, batch=batch, context_tokens=ctx
            )
        )
    res["mix"] = common.with_load(mix, hf, budget)
    if precision == "fp32":  # a check on ours: the same windows, the same scoring
        res["perplexity"] = common.with_load(ppl, hf, model, budget)
    res["peak_rss_mib"] = round(peak_rss_mib())
    return res
