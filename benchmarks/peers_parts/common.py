"""What every engine's part shares: the requests, the perplexity text, the machine's memory
bandwidth, bytes read per decode step, the load average and percentiles."""

from __future__ import annotations

import os
import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

THREADS = 2
MIX_SEED = 0
DECODE_SEED = 1
TEXT = Path(__file__).resolve().parent.parent / "data" / "opticks.txt"
# (batch, context): batch-1 decode, then decode at batch 8 / 32 with 128 and 1k context
DECODE_CONFIGS = ((1, 128), (8, 128), (8, 1024), (32, 128), (32, 1024))
QUICK_DECODE_CONFIGS = ((1, 32), (4, 64))
# llama.cpp's KV cache is f16 by default; ours and HF's are in the model's dtype
KV_BYTES = {"float32": 4, "bfloat16": 2, "f16": 2}


@dataclass(frozen=True)
class Budget:
    """How much each part does (--quick shrinks all of it)."""

    decode_configs: tuple[tuple[int, int], ...] = DECODE_CONFIGS
    decode_steps: int = 32
    mix_requests: int = 48
    mix_prompt: tuple[int, int] = (32, 384)
    mix_output: tuple[int, int] = (16, 192)
    mix_concurrency: int = 32
    ppl_ctx: int = 512  # llama-perplexity's -c: windows of this many tokens, second half scored
    ppl_max_chunks: int = 0  # 0: all

    @classmethod
    def quick(cls) -> Budget:
        return cls(QUICK_DECODE_CONFIGS, 4, 6, (8, 48), (4, 12), 4, 64, 2)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Budget:
        tuples = {
            k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
            for k, v in d.items()
            if isinstance(v, list)
        }
        return cls(**{**d, **tuples})


def mix_requests(vocab: int, budget: Budget, seed: int = MIX_SEED) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) of the mix: the same for every engine."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab) for _ in range(rng.randint(*budget.mix_prompt))],
            rng.randint(*budget.mix_output),
        )
        for _ in range(budget.mix_requests)
    ]


def decode_prompts(vocab: int, batch: int, ctx: int) -> list[list[int]]:
    rng = random.Random(DECODE_SEED)
    return [[rng.randrange(100, vocab) for _ in range(ctx)] for _ in range(batch)]


def text() -> str:
    return TEXT.read_text(encoding="utf-8")


def ppl_chunks(tokens: list[int], budget: Budget) -> list[list[int]]:
    """llama-perplexity's windows: consecutive, non-overlapping, `ppl_ctx` tokens each."""
    n = len(tokens) // budget.ppl_ctx
    if budget.ppl_max_chunks:
        n = min(n, budget.ppl_max_chunks)
    return [tokens[i * budget.ppl_ctx : (i + 1) * budget.ppl_ctx] for i in range(n)]


def ppl_scored(chunk_len: int) -> range:
    """Positions scored in a window (as llama-perplexity: the tokens after its first half, each
    predicted from everything before it in the window)."""
    return range(chunk_len // 2 + 1, chunk_len)


def memory_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """Streaming read of a buffer far larger than L3 (a sum over it) on THREADS threads, on
    4 KiB pages and on huge pages where the OS gives them (as our engine's weights are:
    pagedllm.model.arena); the best of `repeats` of each, in GB/s."""
    import torch

    from pagedllm.model.arena import Arena

    torch.set_num_threads(THREADS)
    plain = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
    huge = Arena(mib << 20).copy(plain)
    best = min(_timed(buf.sum) for buf in (plain, huge) for _ in range(repeats))
    return plain.numel() * 4 / best / 1e9


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def kv_bytes_per_token(cfg: dict[str, Any], elem: int) -> int:
    """K and V of one token over all layers."""
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * elem


def bandwidth_use(
    weight_bytes: int, kv_token_bytes: int, ctx: float, step_s: float, bandwidth_gbs: float
) -> dict[str, Any]:
    """Bytes a batch-1 decode step reads (every weight once, the KV of `ctx` tokens) ÷ its time,
    as a fraction of the measured bandwidth."""
    read = weight_bytes + kv_token_bytes * ctx
    gbs = read / step_s / 1e9
    return {
        "bytes_per_step_mb": round(read / 1e6, 1),
        "achieved_gbs": round(gbs, 2),
        "fraction_of_bandwidth": round(gbs / bandwidth_gbs, 3),
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def with_load(fn: Any, *args: Any, **tags: Any) -> dict[str, Any]:
    """`fn(*args)`'s dict with the load average before and after it; a failure is recorded
    (with `tags`, the traceback's end) and the next part runs."""
    before = loadavg()
    try:
        out = fn(*args)
    except Exception as exc:
        out = {**tags, "error": "".join(traceback.format_exception(exc))[-1500:]}
    return {**out, "loadavg_before": before, "loadavg_after": loadavg()}


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def latency_summary(ttfts_s: list[float]) -> dict[str, float]:
    return {
        "ttft_ms_p50": round(percentile(ttfts_s, 50) * 1e3, 1),
        "ttft_ms_p99": round(percentile(ttfts_s, 99) * 1e3, 1),
        "ttft_ms_mean": round(statistics.fmean(ttfts_s) * 1e3, 1),
    }


def perplexity(nlls: list[float]) -> float:
    import math

    return math.exp(sum(nlls) / len(nlls))


def mix_result(
    requests: int, concurrency: int, elapsed: float, output_tokens: int, ttfts_s: list[float]
) -> dict[str, Any]:
    """One engine's figures for the request mix."""
    return {
        "requests": requests,
        "concurrency": concurrency,
        "seconds": round(elapsed, 2),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        **latency_summary(ttfts_s),
    }


def ppl_result(tokens: list[int], budget: Budget, chunks: int, nlls: list[float]) -> dict[str, Any]:
    """One engine's perplexity of the text, with what was scored."""
    return {
        "text_tokens": len(tokens),
        "ctx": budget.ppl_ctx,
        "chunks": chunks,
        "scored_tokens": len(nlls),
        "ppl": round(perplexity(nlls), 4),
    }
