"""What generation returns, shaped as vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# one dict per position: token id -> Logprob (the chosen token first, then the top ones)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    # the stop string or stop token id that ended the request (None for EOS or length)
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When the request arrived, was first scheduled and got its first token
    (`time.monotonic()` seconds; None until it happened)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        t = self.first_token_time
        return None if t is None else t - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    # prompt tokens whose KV came from the prefix cache
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
