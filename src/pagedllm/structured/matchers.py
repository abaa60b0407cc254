"""The model runner's grammar state: one matcher per constrained request, and the batch's
token bitmask for each step.

A matcher is synced lazily with its request's output tokens when the next mask is filled:
it consumes the tokens it has not seen yet. So whatever the scheduler did with the previous
step (applied it, preempted the request to recompute it, rolled it back after a fault), the
matcher matches the tokens the request really has; nothing has to undo a consumed token.

A speculating request (`spec_token_ids`, docs/speculative.md) gets one mask row per verified
position: its matcher consumes the drafts one at a time, a mask filled after each, then rolls
them all back (the next sync consumes those that were accepted). A draft the grammar refuses
is never accepted (the row before it is masked), so the rows after it get no mask: their
samples are never used. Nor do the rows after a draft EOS, which ends a constrained request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import llguidance
import torch

from pagedllm.structured.grammar import GrammarCompiler
from pagedllm.structured.params import StructuredOutputsParams


@dataclass
class Masks:
    """A step's token bitmask, (rows, words) int32 on the CPU, and the requests whose
    grammar failed (request id -> why)."""

    bitmask: torch.Tensor
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class _State:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has taken


class _Params(Protocol):
    @property
    def structured_outputs(self) -> StructuredOutputsParams | None: ...


class MaskRow(Protocol):
    """What filling one row's mask needs (a `ScheduledRequest` is one)."""

    @property
    def request_id(self) -> str: ...
    @property
    def params(self) -> _Params: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def spec_token_ids(self) -> Sequence[int]: ...


class GrammarMatchers:
    def __init__(self, compiler: GrammarCompiler, eos_token_ids: Sequence[int] = ()) -> None:
        self.compiler = compiler
        self.eos = frozenset(eos_token_ids)
        self.words = (compiler.vocab_size + 31) // 32
        self._states: dict[str, _State] = {}
        self._executor = llguidance.LLExecutor()
        # one thread fills the next mask while the model's forward pass runs
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        """A request's own matcher (a copy of its compiled grammar), made when it arrives:
        the mask thread never compiles."""
        self._states[request_id] = _State(matcher)

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def submit(self, rows: Sequence[MaskRow]) -> Future[Masks | None]:
        """`fill(rows)` on the mask thread."""
        return self._pool.submit(self.fill, rows)

    def fill(self, rows: Sequence[MaskRow]) -> Masks | None:
        """The bitmask of the tokens each row may sample next (all bits set on unconstrained
        rows), one row per request and per draft token (the runner's sampled rows), and the
        requests whose grammar failed (their tokens left it, or it went past the grammar
        engine's limits): they cannot go on. None when no row is constrained."""
        starts = list(itertools.accumulate((1 + len(r.spec_token_ids) for r in rows), initial=0))
        todo = [(i, r) for i, r in enumerate(rows) if r.params.structured_outputs is not None]
        if not todo:
            return None
        pin = torch.cuda.is_available()  # copied to the GPU without a sync
        masks = Masks(torch.full((starts[-1], self.words), -1, dtype=torch.int32, pin_memory=pin))
        pairs, synced = [], []
        for i, row in todo:
            matcher = self._sync(row)
            if isinstance(matcher, str):
                masks.failed[row.request_id] = matcher
            else:
                pairs.append((matcher, starts[i]))
                synced.append((matcher, row, starts[i]))
        # NOTE: not `llguidance.torch`, whose import pulls torch.compile's inductor (seconds)
        bitmask = masks.bitmask
        if pairs:
            self._executor.unsafe_compute_mask_ptr(
                pairs, bitmask.data_ptr(), self.words * 4, starts[-1]
            )
        for matcher, row, at in synced:
            self._fill_drafts(matcher, row.spec_token_ids, bitmask, at)
            if matcher.is_error():
                masks.failed[row.request_id] = _failure(matcher)
        return masks

    def _fill_drafts(
        self, matcher: llguidance.LLMatcher, drafts: Sequence[int], bitmask: torch.Tensor, at: int
    ) -> None:
        """The mask rows after row `at` of a speculating request: the matcher after each
        draft, up to the first the grammar refuses or an EOS; then it is rolled back."""
        if not drafts or matcher.is_error():
            return
        valid = list(drafts[: matcher.validate_tokens(list(drafts))])
        valid = list(itertools.takewhile(lambda t: t not in self.eos, valid))
        row_bytes = self.words * 4
        for j, token in enumerate(valid, start=1):
            matcher.consume_token(token)
            matcher.unsafe_compute_mask_ptr(bitmask[at + j].data_ptr(), row_bytes)
        if valid:
            matcher.rollback(len(valid))

    def _sync(self, row: MaskRow) -> llguidance.LLMatcher | str:
        """The row's matcher, fed the output tokens it has not seen; or why it failed."""
        state = self._states[row.request_id]  # started with the request (`start`)
        new = list(row.output_token_ids[state.consumed :])  # the list only ever grows
        if new and not state.matcher.consume_tokens(new):
            return _failure(state.matcher)
        state.consumed += len(new)
        return state.matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _failure(matcher: llguidance.LLMatcher) -> str:
    error = matcher.get_error().split("<state>")[0]  # then the parser's internal state
    return f"the structured-output constraint failed: {' '.join(error.split())[:500]}"
