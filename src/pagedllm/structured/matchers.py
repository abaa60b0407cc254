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
from dataclasses import dataclass
from typing import Protocol

import llguidance
import torch

from pagedllm.structured.grammar import GrammarCompiler
from pagedllm.structured.params import StructuredOutputsParams


class GrammarViolation(ValueError):
    """A request's tokens left its grammar (the mask allowed no token for it, or a token
    came from elsewhere); the request cannot go on."""


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

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def submit(self, rows: Sequence[MaskRow]) -> Future[torch.Tensor | None]:
        """`fill(rows)` on the mask thread."""
        return self._pool.submit(self.fill, rows)

    def fill(self, rows: Sequence[MaskRow]) -> torch.Tensor | None:
        """The (rows, words) int32 bitmask of the tokens each row may sample next (all bits
        set on unconstrained rows); None when no row is constrained. Raises GrammarViolation
        naming the first request whose tokens its grammar refuses."""
        todo = [(i, r) for i, r in enumerate(rows) if r.params.structured_outputs is not None]
        if not todo:
            return None
        pin = torch.cuda.is_available()  # copied to the GPU without a sync
        bitmask = torch.full((len(rows), self.words), -1, dtype=torch.int32, pin_memory=pin)
        pairs = [(self._sync(r), i) for i, r in todo]
        # NOTE: not `llguidance.torch`, whose import pulls torch.compile's inductor (seconds)
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.words * 4, len(rows))
        return bitmask

    def _sync(self, row: MaskRow) -> llguidance.LLMatcher:
        spec = row.params.structured_outputs
        assert spec is not None
        state = self._states.get(row.request_id)
        if state is None:
            state = self._states[row.request_id] = _State(self.compiler.matcher(spec))
        out = row.output_token_ids  # only ever grows
        new = list(out[state.consumed :])
        if new and not state.matcher.consume_tokens(new):
            error = state.matcher.get_error()
            del self._states[row.request_id]
            raise GrammarViolation(f"request {row.request_id} left its grammar: {error}")
        state.consumed = len(out)
        return state.matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False)
