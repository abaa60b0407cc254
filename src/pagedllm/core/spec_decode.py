"""Speculative decoding, the scheduler's side: which running decodes get a draft this step
and what it is (n-gram prompt lookup), within the step's token budget, the request's limits
and the KV pool; how the drafts fared (vLLM's spec_decode counters) and the adaptive back-off.

A request with a draft `d_1..d_k` is scheduled for `[last, d_1..d_k]` at positions
`p..p+k` in one forward pass; the runner samples every position and keeps the longest run of
drafts its own samples agree with, plus one token (`worker.spec_verify`). Only `last` counts
as computed when scheduled: each accepted draft adds one (its KV is right: it is the token
that was emitted), the rejected tail's slots are overwritten later and the blocks holding only
them are freed (`KVCacheManager.trim`). Prefix-cache hashes are registered for full blocks of
computed tokens only, so never for a rejected token.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    from pagedllm.core.scheduler import Scheduler

# a request whose acceptance fell below `min_acceptance` proposes nothing for this many steps,
# twice as many after each such pause in a row (up to MAX_BACKOFF_STEPS), until a draft of it
# is accepted again: on free-form text the failed drafts' cost stays a few percent
BACKOFF_STEPS = 8
MAX_BACKOFF_STEPS = 64
# weight of the newest draft in a request's acceptance average
ACCEPTANCE_WEIGHT = 0.5


def ngram_propose(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the last n tokens,
    for the largest n in [n_min, n_max] that occurs; [] when none does."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # windows starting at 0 .. length - n - 1: each has a token after it
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@dataclass
class _Acceptance:
    average: float = 1.0  # the share of drafted tokens accepted, recent drafts weighted most
    skip: int = 0  # steps left without proposals
    pause: int = BACKOFF_STEPS  # the next pause's length

    def update(self, share: float, min_acceptance: float) -> None:
        """One verified draft, `share` of it accepted: pause (longer each time in a row) when
        the average falls below `min_acceptance`."""
        w = ACCEPTANCE_WEIGHT
        self.average = (1 - w) * self.average + w * share
        if self.average < min_acceptance:
            self.skip, self.pause = self.pause, min(2 * self.pause, MAX_BACKOFF_STEPS)
            self.average = min_acceptance  # one more try after the pause
        elif share > 0:
            self.pause = BACKOFF_STEPS


@dataclass
class SpecDecoder:
    config: SpeculativeConfig
    # vLLM's counters: drafts, drafted tokens, accepted tokens, accepted per draft position
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    _acceptance: weakref.WeakKeyDictionary[Request, _Acceptance] = field(
        default_factory=weakref.WeakKeyDictionary
    )

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.config.num_speculative_tokens

    def draft(self, request: Request, budget: int, scheduler: Scheduler) -> list[int]:
        """Draft tokens for a running request whose next step is one decode token, at most
        `budget` of them; [] when it should not speculate."""
        cfg, params, kv = self.config, request.sampling_params, scheduler.kv
        if scheduler.num_running > cfg.max_batch_size:
            return []
        state = self._acceptance.setdefault(request, _Acceptance())
        if state.skip > 0:
            state.skip -= 1
            return []
        # every emitted token must stay within max_tokens and the context (one token is
        # always emitted besides the accepted drafts)
        left = scheduler.config.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            left = min(left, params.max_tokens - request.num_output_tokens - 1)
        k = min(cfg.num_speculative_tokens, budget, left)
        if k <= 0:
            return []
        if cfg.method == "draft_model":  # placeholders the runner's draft model fills in
            draft = [0] * k  # (worker/draft_runner.py), before the step's forward pass
        else:
            draft = ngram_propose(
                request.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )
        if draft and kv.num_blocks_needed([(request, 1 + len(draft))]) > kv.pool.num_free_blocks:
            return []  # no room: a plain decode rather than a preemption
        return draft

    def counters(self) -> tuple[int, int, int, tuple[int, ...]]:
        """vLLM's spec_decode counters: drafts, draft tokens, accepted tokens, per position."""
        return (
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.accepted_per_pos),
        )

    def verified(
        self, request: Request, num_drafted: int, num_accepted: int, kv: KVCacheManager
    ) -> None:
        """One verified draft of `request` (applied to it): the blocks that hold only its
        rejected tail's slots are freed; counters and its acceptance average."""
        kv.trim(request)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        state = self._acceptance.setdefault(request, _Acceptance())
        state.update(num_accepted / num_drafted, self.config.min_acceptance)
