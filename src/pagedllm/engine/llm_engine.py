"""The engine step: schedule, execute, update — and requests in, outputs out."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
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


class LLMEngine:
    """Owns the scheduler, the model runner and the tokenizer. Not thread-safe: one thread
    drives `step()`; other threads hand it requests through a queue."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.runner = ModelRunner(config)
        self._prompts: dict[str, str | None] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (text or token ids). Raises ValueError for one that cannot run."""
        if isinstance(prompt, str):
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = [int(t) for t in prompt], None
        vocab = self.config.model.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        eos = frozenset(self.config.model.eos_token_ids)
        request = Request(request_id, token_ids, params, eos, arrival_time or time.monotonic())
        self.scheduler.add_request(request)
        self._prompts[request_id] = text

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return None if request is None else self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that got a token."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.runner.execute(sched)
        changed = self.scheduler.update_from_output(sched, result)
        return [self._output(r) for r in changed]

    def _output(self, request: Request) -> RequestOutput:
        reason = request.status.finish_reason
        finished = reason is not None
        # NOTE: text is decoded once, at the end; streaming deltas come from the incremental
        # detokenizer in `pagedllm.text`.
        text = self.tokenizer.decode(request.output_token_ids) if finished else ""
        prompt = self._prompts.pop(request.request_id) if finished else None
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(request.output_token_ids), reason)],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
        )

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.scheduler.kv
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            kv_blocks_used=kv.pool.num_used_blocks,
            kv_blocks_total=kv.pool.num_blocks,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
