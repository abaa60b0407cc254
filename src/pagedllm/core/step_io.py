"""What a scheduler step hands the model runner (`ScheduledRequest`, `SchedulerOutput`) and
what the runner hands back (`RunnerOutput`); `core/scheduler.py` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.lora.request import LoRARequest
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions `start_pos...`."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    # the chunk reaches the request's last known token: sample the next one
    sample: bool
    # what the sampler needs (references to the request's own lists, not copies)
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None = None
    state_slot: int = -1  # its linear-attention state slot (a hybrid model), else -1
    lora_request: LoRARequest | None = None
    # speculative decoding: draft tokens after `token_ids[0]` (core.spec_decode), verified
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # requests that left the scheduler since the previous step (runners drop their state)
    finished_ids: list[str] = field(default_factory=list)
    # requests scheduled for the first time, and those resumed after a preemption
    admitted: list[Request] = field(default_factory=list)
    resumed_ids: list[str] = field(default_factory=list)
    # (source, destination) KV blocks to copy before the forward pass (beams' copy-on-write)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """What the model runner produced for a step: the sampled token of each request that
    was sampled, and log-probabilities where asked (see `pagedllm.layers.sampler`)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # request -> (top ids, top logprobs, chosen logprob, chosen rank)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request -> (position of the first prompt token scored, one entry per scored token)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # requests that cannot go on (their grammar failed) -> why; their tokens are not kept
    failed: dict[str, str] = field(default_factory=dict)
    # speculative decoding: the tokens emitted after the sampled one (one per accepted draft
    # token), and their log-probabilities where asked
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


TokenLogprobs = tuple[list[int], list[float], float, int]
