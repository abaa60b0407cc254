"""The engine's stats as Prometheus metric updates with vLLM's names, for Triton's metrics port
(the `llm_engine` model applies them with `pb_utils.MetricFamily`). Pure: it keeps the last
counter values and turns cumulative counts into increments."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.engine.metrics import HISTOGRAMS
from pagedllm.kv_cache_dtype import dtype_name

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import EngineStats

# not vLLM's: pagedllm's admission control (docs/serving.md, Limits and errors)
REJECTED = "pagedllm:requests_rejected_total"
COUNTERS = {
    "vllm:prompt_tokens_total": "Prompt tokens of the requests scheduled.",
    "vllm:generation_tokens_total": "Tokens generated.",
    "vllm:num_preemptions_total": "Requests preempted (by recompute) to free KV blocks.",
    "vllm:prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "vllm:prefix_cache_hits_total": "Prompt tokens found in the prefix cache.",
    "vllm:request_success_total": "Finished requests, by finish reason.",
    REJECTED: "Requests refused at once because max_queued_requests were waiting.",
    "vllm:spec_decode_num_drafts_total": "Speculative drafts verified.",
    "vllm:spec_decode_num_draft_tokens_total": "Draft tokens proposed.",
    "vllm:spec_decode_num_accepted_tokens_total": "Draft tokens accepted.",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "Draft tokens accepted, by position.",
}
GAUGES = {
    "vllm:num_requests_running": "Requests in the running batch.",
    "vllm:num_requests_waiting": "Requests waiting to be scheduled.",
    "vllm:kv_cache_usage_perc": "Fraction of KV-cache blocks held by requests (1 = all).",
}
# vLLM's "info" gauges, the facts in their labels: set once to 1 (the cache config); a series
# per state, its value the time that state was last seen (LoRA, with LoRA on)
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
INFO = {
    CACHE_CONFIG_INFO: "Information of the LLMEngine CacheConfig",
    LORA_REQUESTS_INFO: "Running stats on lora requests.",
}
__all__ = [
    "CACHE_CONFIG_INFO",
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "INFO",
    "LORA_REQUESTS_INFO",
    "REJECTED",
    "MetricsExporter",
    "Update",
    "cache_config_info",
]


def cache_config_info(config: EngineConfig, num_blocks: int) -> dict[str, str]:
    """The labels of vllm:cache_config_info, named as vLLM names its CacheConfig fields (the
    values as strings, as vLLM writes them). The Gateway API Inference Extension's endpoint
    picker reads `block_size` and `num_gpu_blocks` (its prefix-cache scorer); `num_blocks`:
    the KV blocks of the pool the engine allocated, on whatever device it runs (vLLM's
    name says GPU); `cache_dtype`: the KV cache's element type (int8, fp8_e4m3, fp8_e5m2, or
    the model's dtype where kv_cache_dtype is auto)."""
    return {
        "block_size": str(config.cache.block_size),
        "num_gpu_blocks": str(num_blocks),
        "cache_dtype": dtype_name(config.cache.cache_dtype, config.dtype),
        "enable_prefix_caching": str(config.cache.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "engine": "0",
    }


@dataclass(frozen=True)
class Update:
    kind: str  # "counter" (value: an increment) | "gauge" | "histogram" (one observation)
    name: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()  # besides model and version


class MetricsExporter:
    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def updates(
        self, stats: EngineStats, observations: list[tuple[str, float]]
    ) -> Iterator[Update]:
        totals: list[tuple[str, tuple[tuple[str, str], ...], float]] = [
            ("vllm:prompt_tokens_total", (), stats.prompt_tokens),
            ("vllm:generation_tokens_total", (), stats.generation_tokens),
            ("vllm:num_preemptions_total", (), stats.num_preemptions),
            ("vllm:prefix_cache_queries_total", (), stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits_total", (), stats.prefix_cache_hits),
        ]
        totals += [
            ("vllm:request_success_total", (("finished_reason", reason),), n)
            for reason, n in stats.finished
        ]
        totals += _spec_totals(stats)
        for name, labels, total in totals:
            delta = total - self._last.get((name, labels), 0)
            if delta:
                self._last[(name, labels)] = total
                yield Update("counter", name, delta, labels)
        for name, value in observations:
            yield Update("histogram", name, value)
        # gauges last: a scraper that sees the engine idle also sees everything counted
        yield Update("gauge", "vllm:num_requests_running", stats.num_running)
        yield Update("gauge", "vllm:num_requests_waiting", stats.num_waiting)
        usage = stats.kv_blocks_used / stats.kv_blocks_total
        yield Update("gauge", "vllm:kv_cache_usage_perc", usage)
        if stats.lora is not None:  # LoRA on
            yield Update("gauge", LORA_REQUESTS_INFO, time.time(), _lora_labels(stats))


def _lora_labels(stats: EngineStats) -> tuple[tuple[str, str], ...]:
    """vLLM's labels: max_lora, and the adapters of the running / waiting requests, each
    comma-separated."""
    assert stats.lora is not None
    return (
        ("max_lora", str(stats.lora.max_loras)),
        ("running_lora_adapters", ",".join(stats.lora.running)),
        ("waiting_lora_adapters", ",".join(stats.lora.waiting)),
    )


def _spec_totals(stats: EngineStats) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Speculative decoding's counters (none when it is off)."""
    if stats.spec_decode is None:
        return []
    drafts, draft_tokens, accepted, per_pos = stats.spec_decode
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    return [
        ("vllm:spec_decode_num_drafts_total", (), drafts),
        ("vllm:spec_decode_num_draft_tokens_total", (), draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens_total", (), accepted),
        *((name, (("position", str(i)),), n) for i, n in enumerate(per_pos)),
    ]


def scrape(metrics_url: str) -> dict[str, float]:
    """The vllm:* (and pagedllm:*) samples of a server's metrics endpoint, keyed by
    name{labels} without the model and version labels, e.g.
    `vllm:request_success_total{finished_reason=abort}`."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        m = re.match(r"((?:vllm|pagedllm):\w+)\{([^}]*)\} (\S+)", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            extra = ",".join(f"{k}={v}" for k, v in labels.items() if k not in ("model", "version"))
            samples[m.group(1) + (f"{{{extra}}}" if extra else "")] = float(m.group(3))
    return samples
