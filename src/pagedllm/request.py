"""A request's state as the scheduler sees it: its tokens and how many are in the KV cache."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One generation request.

    `num_computed_tokens` catches up with `num_tokens` (prompt + output so far): a prefill is
    a request far behind, a decode is one token behind. There are no phases.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # token ids that end the request (the model's EOS ids + stop_token_ids), unless ignore_eos
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # tokens of the prompt found in the prefix cache at the latest admission
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # chained hashes of this request's full blocks, extended as tokens arrive
    block_hashes: list[bytes] = field(default_factory=list)
    # the random stream's seed (a sampling `seed`, offset per sample when n > 1)
    seed: int | None = None
    # set when the request stopped on a token id in `stop_token_ids` (its stop_reason)
    stop_token_id: int | None = None
    # lifecycle times (time.monotonic()), for metrics
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # the adapter it runs with (None: the base model); it roots the block hashes
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
