"""Turns scheduler updates into `RequestOutput`s: incremental text, stop strings (with the
hold-back of text that may still become one), log-probabilities, and the `n` samples of a
request gathered into one output."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.scheduler import RunnerOutput, TokenLogprobs
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.text.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from pagedllm.text.tokenizer import Tokenizer


@dataclass
class _Sample:
    """One of a request's `n` samples."""

    index: int
    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""  # visible text: stop strings cut, hold-back excluded until finished
    sent_chars: int = 0  # DELTA: text already sent
    sent_tokens: int = 0
    sent_logprobs: int = 0
    changed: bool = False
    seen: int = 0  # output tokens processed (a step may bring several: speculation)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    prompt_logprobs: PromptLogprobs | None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    done: set[int] = field(default_factory=set)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1) -> None:
        """`stream_interval`: a DELTA output goes out when a sample has its first token, has
        finished, or has this many tokens not sent yet (EngineConfig.stream_interval)."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._states: dict[str, _RequestState] = {}
        self._sample_of: dict[str, tuple[_RequestState, _Sample]] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        params = children[0].sampling_params
        # text is decoded as tokens arrive only when stop strings or streaming need it
        incremental = params.detokenize and (
            bool(params.stop) or params.output_kind != RequestOutputKind.FINAL_ONLY
        )
        samples = [
            _Sample(
                i,
                child,
                IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                if incremental
                else None,
                [] if params.logprobs is not None else None,
                0.0 if params.logprobs is not None else None,
            )
            for i, child in enumerate(children)
        ]
        prompt_ids = children[0].prompt_token_ids
        state = _RequestState(
            request_id,
            prompt,
            prompt_ids,
            params,
            samples,
            [None] if params.prompt_logprobs is not None else None,
        )
        self._states[request_id] = state
        for sample in samples:
            self._sample_of[sample.request.request_id] = (state, sample)

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def child_ids(self, request_id: str) -> list[str]:
        return [s.request.request_id for s in self._states[request_id].samples]

    def process(
        self, changed: list[Request], result: RunnerOutput
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to emit, and the child requests a stop string finished (the
        engine finishes them in the scheduler)."""
        stopped: list[str] = []
        touched: dict[str, _RequestState] = {}
        for child_id, (start, entries) in result.prompt_logprobs.items():
            if child_id in self._sample_of:
                state, _ = self._sample_of[child_id]
                self._add_prompt_logprobs(state, start, entries)
        for request in changed:
            state, sample = self._sample_of[request.request_id]
            rid = request.request_id
            first = result.logprobs.get(rid)
            lps = [] if first is None else [first, *result.spec_logprobs.get(rid, ())]
            if self._update(sample, state.params, lps) and not request.status.is_finished:
                stopped.append(request.request_id)
            touched[state.request_id] = state
        return [o for o in (self._output(s) for s in touched.values()) if o], stopped

    def _update(self, sample: _Sample, params: SamplingParams, lps: list[TokenLogprobs]) -> bool:
        """Advance one sample over its new tokens, one at a time. True if a stop string ended
        it: a speculative step's tokens after the one that completed it are dropped (as if
        the request had stopped there)."""
        request = sample.request
        new = request.output_token_ids[sample.seen :]
        for i, token in enumerate(new):
            sample.seen += 1
            if i < len(lps) and sample.logprobs is not None:
                self._add_logprobs(sample, token, lps[i], params)
            if self._advance(sample, params, token, i == len(new) - 1):
                del request.output_token_ids[sample.seen :]
                del request.all_token_ids[request.num_prompt_tokens + sample.seen :]
                return True
        return False

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._states.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
                sample.changed = True
                state.done.add(sample.index)
        return self._output(state, force=True)

    def _advance(self, sample: _Sample, params: SamplingParams, token: int, last: bool) -> bool:
        """Advance one sample's text after a new token (`last`: the step's last for it).
        True if a stop string ended it."""
        request = sample.request
        sample.changed = True
        status = request.status
        finished = status.is_finished and last
        stop_string = False
        if sample.detok is not None:
            # the stop token's own text is not shown (unless asked): as vLLM
            stop_token = finished and status == RequestStatus.FINISHED_STOPPED
            new_ids = [token]
            if stop_token and not params.include_stop_str_in_output:
                new_ids = []
            before = len(sample.detok.text)
            sample.detok.add_tokens(new_ids, final=finished)
            text = sample.detok.text
            hit = None
            if params.stop and sample.seen > params.min_tokens:
                hit = find_stop(text, params.stop, before)
            if hit is not None:
                i, stop = hit
                text = text[: i + len(stop)] if params.include_stop_str_in_output else text[:i]
                sample.stop_reason = stop
                sample.finish_reason = "stop"
                finished = stop_string = True
            elif not finished:
                text = text[: len(text) - stop_holdback(text, params.stop)]
            sample.text = text
        if finished and sample.finish_reason is None:
            sample.finish_reason = status.finish_reason
            sample.stop_reason = request.stop_token_id
            if sample.detok is None and params.detokenize:
                sample.text = self._final_text(request, params)
        return stop_string

    def _final_text(self, request: Request, params: SamplingParams) -> str:
        ids = request.output_token_ids
        if (
            request.status == RequestStatus.FINISHED_STOPPED
            and not params.include_stop_str_in_output
        ):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, params.skip_special_tokens)

    def _add_logprobs(
        self, sample: _Sample, token: int, lp: TokenLogprobs, params: SamplingParams
    ) -> None:
        assert sample.logprobs is not None and sample.cumulative_logprob is not None
        sample.logprobs.append(self._logprob_dict(token, lp, params.detokenize))
        sample.cumulative_logprob += lp[2]

    def _add_prompt_logprobs(
        self, state: _RequestState, start: int, entries: list[TokenLogprobs]
    ) -> None:
        assert state.prompt_logprobs is not None
        for k, lp in enumerate(entries):
            pos = start + k
            if pos == len(state.prompt_logprobs):  # positions recomputed after a preemption
                state.prompt_logprobs.append(
                    self._logprob_dict(state.prompt_token_ids[pos], lp, state.params.detokenize)
                )

    def _logprob_dict(self, token: int, lp: TokenLogprobs, decode: bool) -> dict[int, Logprob]:
        top_ids, top_vals, chosen, rank = lp

        def text(tid: int) -> str | None:
            return self.tokenizer.decode([tid], False) if decode else None

        out = {token: Logprob(chosen, rank, text(token))}
        for r, (tid, val) in enumerate(zip(top_ids, top_vals, strict=True), start=1):
            if tid not in out:
                out[tid] = Logprob(val, r, text(tid))
        return out

    def _output(self, state: _RequestState, force: bool = False) -> RequestOutput | None:
        for s in state.samples:
            if s.finish_reason is not None:
                state.done.add(s.index)
        finished = len(state.done) == len(state.samples)
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished and not force:
            return None
        if kind == RequestOutputKind.DELTA and not (finished or force or self._due(state)):
            return None  # the changes wait for the next output
        if kind == RequestOutputKind.DELTA:
            samples = [s for s in state.samples if s.changed]
        else:
            samples = state.samples
        outs = [self._completion(s, kind) for s in samples]
        for s in state.samples:
            s.changed = False
        prompt_lp = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            prompt_lp = None if state.prompt_logprobs_sent else prompt_lp
        state.prompt_logprobs_sent = True
        if finished:
            self._drop(state)
        first = state.samples[0].request
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=finished,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(
                first.arrival_time, first.first_scheduled_time, first.first_token_time
            ),
        )

    def _due(self, state: _RequestState) -> bool:
        """A changed sample has its first token or `stream_interval` tokens unsent, or has
        finished (n > 1: the others go on)."""
        if self.stream_interval == 1:
            return True
        return any(
            s.sent_tokens == 0
            or s.finish_reason is not None
            or len(s.request.output_token_ids) - s.sent_tokens >= self.stream_interval
            for s in state.samples
            if s.changed
        )

    @staticmethod
    def _completion(s: _Sample, kind: RequestOutputKind) -> CompletionOutput:
        ids = s.request.output_token_ids
        if kind == RequestOutputKind.DELTA:
            text, token_ids = s.text[s.sent_chars :], ids[s.sent_tokens :]
            logprobs = s.logprobs[s.sent_logprobs :] if s.logprobs is not None else None
            s.sent_chars, s.sent_tokens = len(s.text), len(ids)
            s.sent_logprobs = len(s.logprobs or ())
        else:
            text, token_ids, logprobs = s.text, list(ids), s.logprobs
        return CompletionOutput(
            index=s.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    def _drop(self, state: _RequestState) -> None:
        self._states.pop(state.request_id, None)
        for s in state.samples:
            self._sample_of.pop(s.request.request_id, None)
