"""The engine's request-lifecycle measurements, under vLLM's metric names so existing dashboards
work: cumulative counters and the per-request / per-token observations for histograms.
`LLMEngine` records them as requests are scheduled, produce tokens and finish; an exporter
(the Triton `llm_engine` model: `pagedllm.serving.metrics`) drains the observations."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable

from pagedllm.request import Request

# histogram name -> (description, bucket upper bounds)
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_LONG = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "vllm:time_to_first_token_seconds": ("Time to first token.", (*_LATENCY, 7.5, 10.0)),
    "vllm:time_per_output_token_seconds": ("Inter-token latency.", _LATENCY),
    "vllm:e2e_request_latency_seconds": ("Arrival to finish.", _LONG),
    "vllm:request_queue_time_seconds": ("Arrival to first scheduled.", _LONG),
    "vllm:request_prompt_tokens": ("Prompt tokens per request.", _TOKENS),
    "vllm:request_generation_tokens": ("Generated tokens per request.", _TOKENS),
    "vllm:request_params_n": ("Histogram of the n request parameter.", (1, 2, 5, 10, 20)),
}


class EngineMetrics:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # finish reason -> requests
        self._observations: list[tuple[str, float]] = []
        # output tokens counted per request (a speculative step brings several)
        self._counted: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def scheduled(self, first_time: Iterable[Request], now: float) -> None:
        """Requests scheduled for the first time."""
        for r in first_time:
            self.prompt_tokens += r.num_prompt_tokens
            self._observations.append(("vllm:request_queue_time_seconds", now - r.arrival_time))

    def new_token(self, r: Request, now: float) -> None:
        """Before the engine stamps the request with `now`."""
        self.generation_tokens += r.num_output_tokens - self._counted.get(r, 0)
        self._counted[r] = r.num_output_tokens
        if r.first_token_time is None:
            self._observations.append(("vllm:time_to_first_token_seconds", now - r.arrival_time))
        else:
            assert r.last_token_time is not None
            gap = now - r.last_token_time
            self._observations.append(("vllm:time_per_output_token_seconds", gap))

    def request_finished(self, r: Request, now: float, last_sample: bool = True) -> None:
        """One sequence finished (`last_sample`: the last of its request's n, as vLLM
        observes `n` once per request)."""
        self.finished[r.status.finish_reason or ""] += 1
        self._observations += [
            ("vllm:e2e_request_latency_seconds", now - r.arrival_time),
            ("vllm:request_prompt_tokens", r.num_prompt_tokens),
            ("vllm:request_generation_tokens", r.num_output_tokens),
        ]
        if last_sample:
            self._observations.append(("vllm:request_params_n", r.sampling_params.n))

    def drain(self) -> list[tuple[str, float]]:
        """The histogram observations since the previous call."""
        out, self._observations = self._observations, []
        return out
