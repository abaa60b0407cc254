"""The engine step: schedule, execute, update — and requests in, outputs out."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.metrics import EngineMetrics
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.tracing import Tracer
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams
from pagedllm.text import Tokenizer
from pagedllm.worker.model_runner import ModelRunner


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # (finish reason, requests), sorted
    finished: tuple[tuple[str, int], ...] = ()


class LLMEngine:
    """Owns the scheduler, the model runner, the tokenizer and the output processor. Not
    thread-safe: one thread drives `step()`; other threads hand it requests through a queue."""

    def __init__(
        self,
        config: EngineConfig,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        metrics: bool = True,
        trace_file: str | None = None,
    ) -> None:
        """`metrics`: record vLLM's counters and histograms (`self.metrics`); `trace_file`:
        append request-lifecycle events there, one JSON object per line (`engine.tracing`)."""
        self.config = config
        self.max_logprobs = max_logprobs
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.runner = ModelRunner(config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics() if metrics else None
        self.tracer = Tracer(trace_file) if trace_file else None

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (text or token ids). Raises ValueError for one that cannot run;
        nothing is queued then."""
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = [int(t) for t in prompt], None
        vocab = self.config.model.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params.check_logprobs_cap(self.max_logprobs)
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        eos = frozenset(self.config.model.eos_token_ids)
        now = arrival_time or time.monotonic()
        children = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                token_ids,
                params,
                eos,
                now,
                seed=None if params.seed is None else params.seed + i,
            )
            for i in range(params.n)
        ]
        for child in children:
            self.scheduler.add_request(child)
            if self.tracer is not None:
                self.tracer.event("queued", child.request_id, prompt_tokens=len(token_ids))
        self.output_processor.add_request(request_id, text, children)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (all its samples) and free its blocks at once."""
        if not self.output_processor.has(request_id):
            return None
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.abort(child_id)
        self._record_finished(time.monotonic())
        return self.output_processor.abort(request_id)

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that changed."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        start = time.monotonic()
        for request in sched.admitted:
            request.first_scheduled_time = start
        if self.tracer is not None:
            self._trace_scheduled(sched)
        if self.metrics is not None:
            self.metrics.scheduled(sched.admitted, start)
        result = self.runner.execute(sched)
        changed = self.scheduler.update_from_output(sched, result)
        now = time.monotonic()
        for request in changed:
            if self.metrics is not None:
                self.metrics.new_token(request, now)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
        outputs, stopped = self.output_processor.process(changed, result)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self.tracer is not None:
            self._trace_step(sched, changed, now - start)
        self._record_finished(now)
        return outputs

    def _record_finished(self, now: float) -> None:
        for request in self.scheduler.just_finished:
            if self.metrics is not None:
                self.metrics.request_finished(request, now)
            if self.tracer is not None:
                self.tracer.event(
                    "finished",
                    request.request_id,
                    reason=request.status.finish_reason,
                    output_tokens=request.num_output_tokens,
                )
        self.scheduler.just_finished.clear()

    def _trace_scheduled(self, sched: SchedulerOutput) -> None:
        assert self.tracer is not None
        for request_id in sched.preempted_ids:
            self.tracer.event("preempted", request_id)
        for request in sched.admitted:
            self.tracer.event("scheduled", request.request_id, cached=request.num_cached_tokens)
        for request_id in sched.resumed_ids:
            self.tracer.event("resumed", request_id)

    def _trace_step(self, sched: SchedulerOutput, changed: list[Request], duration: float) -> None:
        assert self.tracer is not None
        prefill_tokens = 0
        for s in sched.scheduled:
            if s.start_pos < len(s.prompt_token_ids):  # a prompt chunk (or its recompute)
                prefill_tokens += s.num_tokens
                self.tracer.event(
                    "prefill_chunk",
                    s.request_id,
                    start=s.start_pos,
                    tokens=s.num_tokens,
                    duration=round(duration, 6),
                )
        for request in changed:
            if request.num_output_tokens == 1:
                self.tracer.event("first_token", request.request_id)
        self.tracer.event(
            "step",
            duration=round(duration, 6),
            requests=len(sched.scheduled),
            prefill_tokens=prefill_tokens,
            decode_tokens=sched.num_tokens - prefill_tokens,
        )

    def stats(self) -> EngineStats:
        s, kv, m = self.scheduler, self.scheduler.kv, self.metrics
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            kv_blocks_used=kv.pool.num_used_blocks,
            kv_blocks_total=kv.pool.num_blocks,
            prompt_tokens=m.prompt_tokens if m else 0,
            generation_tokens=m.generation_tokens if m else 0,
            finished=tuple(sorted(m.finished.items())) if m else (),
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
