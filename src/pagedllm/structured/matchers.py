"""The model runner's grammar state: one matcher per constrained request, and the batch's
token bitmask for each step.

A matcher is synced lazily with its request's output tokens when the next mask is filled:
it consumes the tokens it has not seen yet. So whatever the scheduler did with the previous
step (applied it, preempted the request to recompute it, rolled it back after a fault), the
matcher matches the tokens the request really has; nothing has to undo a consumed token.
"""

from __future__ import annotations

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


class GrammarMatchers:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
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
        rows), and the requests whose grammar failed (their tokens left it, or it went past
        the grammar engine's limits): they cannot go on. None when no row is constrained."""
        todo = [(i, r) for i, r in enumerate(rows) if r.params.structured_outputs is not None]
        if not todo:
            return None
        pin = torch.cuda.is_available()  # copied to the GPU without a sync
        masks = Masks(torch.full((len(rows), self.words), -1, dtype=torch.int32, pin_memory=pin))
        pairs = []
        for i, row in todo:
            matcher = self._sync(row)
            if isinstance(matcher, str):
                masks.failed[row.request_id] = matcher
            else:
                pairs.append((matcher, i))
        # NOTE: not `llguidance.torch`, whose import pulls torch.compile's inductor (seconds)
        bitmask = masks.bitmask
        if pairs:
            self._executor.unsafe_compute_mask_ptr(
                pairs, bitmask.data_ptr(), self.words * 4, len(rows)
            )
        for matcher, i in pairs:
            if matcher.is_error():
                masks.failed[rows[i].request_id] = _failure(matcher)
        return masks

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
