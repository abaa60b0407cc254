"""The engine step: schedule, execute, update — and requests in, outputs out."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.core.beam_group import BeamGroup
from pagedllm.core.scheduler import RunnerOutput, ScheduledRequest, Scheduler, SchedulerOutput
from pagedllm.core.spec_decode import SpecDecoder
from pagedllm.engine.faults import (
    EngineDeadError,
    FaultInjection,
    GrammarFailedError,
    RequestFailedError,
    describe,
    find_culprits,
    is_fatal,
)
from pagedllm.engine.metrics import EngineMetrics
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.tracing import Tracer
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import check_request
from pagedllm.lora.stats import LoRARequestsInfo, lora_requests_info
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams
from pagedllm.text import Tokenizer
from pagedllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagedllm.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

# a request rolled back by this many failed steps in a row, with no token in between, means the
# fault is not one request's (the step keeps failing): the engine is poisoned
MAX_ROLLBACKS = 3


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
    # block-table entries freed because they fell out of every layer's sliding window, and
    # the most blocks in use at once (both since the engine started)
    kv_blocks_freed_by_window: int = 0
    kv_blocks_peak: int = 0
    # the KV cache (config.kv_cache_report): bytes per token on a rank, all layers and scales
    kv_bytes_per_token: int = 0
    kv_cache_dtype: str = ""  # int8, fp8_e4m3, fp8_e5m2, or the model's dtype
    kv_token_capacity: int = 0  # tokens its blocks hold
    # speculative decoding (None when off): drafts, draft tokens, accepted tokens, and the
    # accepted tokens per draft position, since the engine started
    spec_decode: tuple[int, int, int, tuple[int, ...]] | None = None
    lora: LoRARequestsInfo | None = None  # the adapters running and waiting (None: LoRA off)


class LLMEngine:
    """Owns the scheduler, the model runner, the tokenizer and the output processor. Not
    thread-safe: one thread drives `step()`; other threads hand it requests through a queue."""

    def __init__(
        self,
        config: EngineConfig,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        metrics: bool = True,
        trace_file: str | None = None,
        fault_injection: FaultInjection | None = None,
    ) -> None:
        """`metrics`: record vLLM's counters and histograms (`self.metrics`); `trace_file`:
        append request-lifecycle events there, one JSON object per line (`engine.tracing`);
        `fault_injection`: a test hook (`engine.faults`), None (off) in production."""
        self.config = config
        self.max_logprobs = max_logprobs
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        if config.speculative is not None:
            self.scheduler.spec = SpecDecoder(config.speculative)
        self.runner = ModelRunner(config)
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval)
        self.metrics = EngineMetrics() if metrics else None
        self.tracer = Tracer(trace_file) if trace_file else None
        # the injector wraps the runner only when on: off, a step calls the runner directly
        execute = self.runner.execute
        self._execute = execute if fault_injection is None else fault_injection.wrap(execute)
        # requests a fault failed (parent id -> error), for the caller to take after a step
        self.request_errors: dict[str, RequestFailedError | GrammarFailedError] = {}
        # set when the engine is poisoned (see `engine.faults`): why
        self.dead_reason: str | None = None
        # request id -> (its output tokens at its latest rollback, rollbacks in a row there)
        self._rollbacks: dict[str, tuple[int, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (text or token ids), on a LoRA adapter if `lora_request`. Raises
        ValueError for one that cannot run; nothing is queued then. Raises EngineDeadError
        once the engine is poisoned."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
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
        params.check_token_ids(vocab)  # logit_bias / allowed_token_ids: ids of this model
        if params.bad_words or params.bad_words_ids:
            params = dataclasses.replace(params)  # the caller's object stays as it was
            params.update_from_tokenizer(self._encode_word, vocab)
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        check_request(self.runner.lora, lora_request)  # the adapter read (and cached) here
        grammar = None
        if params.structured_outputs is not None:  # a bad schema is refused here, not later
            # (a server compiles on the request's own thread first: this is a cache hit)
            grammar = self.grammar_compiler().compile(params.structured_outputs)
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
                lora_request=lora_request,
            )
            for i in range(params.n)
        ]
        for child in children:
            self.scheduler.add_request(child)
            if grammar is not None:
                assert self.runner.grammars is not None
                self.runner.grammars.start(child.request_id, grammar.deep_copy())
            if self.tracer is not None:
                self.tracer.event("queued", child.request_id, prompt_tokens=len(token_ids))
        self.output_processor.add_request(request_id, text, children)

    def add_beam_search(
        self, request_id: str, prompt: str | list[int], params: BeamSearchParams
    ) -> None:
        """Queue a beam search (`core.beam_group`); its live beams after each step:
        `scheduler.beams.groups[request_id].live_sequences()`."""
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        mcfg, now = self.config.model, time.monotonic()
        group = BeamGroup.create(request_id, ids, params, mcfg, self.max_logprobs, now)
        self.scheduler.add_beam_group(group)

    def take_beam_search_outputs(self) -> list[tuple[str, BeamSearchOutput]]:
        """The beam searches finished since the last call (request id, output), each text the
        whole sequence with special tokens (vLLM's `tokenizer.decode(beam.tokens)`)."""
        return self.scheduler.beams.take_outputs(
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        )

    def grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler, made on first use: llguidance reads the tokenizer's
        vocabulary then (~0.4 s for 49k tokens). A server calls it at start-up; the offline
        API with the first constrained request."""
        if self.runner.grammars is None:
            from pagedllm.structured.grammar import GrammarCompiler
            from pagedllm.structured.matchers import GrammarMatchers

            mcfg = self.config.model
            compiler = GrammarCompiler(
                self.tokenizer.to_json(), mcfg.vocab_size, list(mcfg.eos_token_ids)
            )
            self.runner.grammars = GrammarMatchers(compiler, mcfg.eos_token_ids)
        return self.runner.grammars.compiler

    def _encode_word(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (all its samples, or a beam search's beams), freeing its blocks."""
        if not self.output_processor.has(request_id):
            self.scheduler.abort_beam_group(request_id)
            return None
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.abort(child_id)
        self._record_finished(time.monotonic())
        return self.output_processor.abort(request_id)

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()
        if self.runner.grammars is not None:
            self.runner.grammars.close()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that changed. A request
        that failed in the model runner is aborted (its output is among these, finish_reason
        "abort") and its error put in `request_errors`; EngineDeadError when the fault is not
        one request's (the engine is then poisoned for good)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        start = time.monotonic()
        for request in sched.admitted:
            request.first_scheduled_time = start
        if self.tracer is not None:
            self.tracer.scheduled(sched)
        if self.metrics is not None:
            self.metrics.scheduled(sched.admitted, start)
        try:
            result = self._execute(sched)
        except Exception as e:
            return self._recover(sched, e)
        failed = self._fail_grammars(result.failed)  # before their tokens are applied
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
            self.tracer.step(sched, changed, now - start)
        self._record_finished(now)
        return failed + outputs

    def _fail_grammars(self, failed: dict[str, str]) -> list[RequestOutput]:
        """Abort the requests whose grammar failed in the runner (all their samples)."""
        outputs = []
        for child_id, why in failed.items():
            parent = self._parent_of(child_id)
            if parent is None:
                continue
            logger.warning("request %s stopped: %s", parent, why)
            self.request_errors[parent] = GrammarFailedError(why)
            if (out := self.abort_request(parent)) is not None:
                outputs.append(out)
        return outputs

    def _recover(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The runner raised during `sched` (not applied to the scheduler): re-run halves of
        the step until the requests that fail on their own are found, fail them, and roll
        the others back to be recomputed (the same tokens as without the fault: seeded
        streams are rebuilt where they stood). Poison when the fault is not one request's."""
        if isinstance(error, EngineDeadError):  # a tensor-parallel step, or already poisoned
            if self.dead_reason is None:
                self._poison(str(error), error)
            raise error
        batch = sched.scheduled
        logger.error("engine step of %d requests failed", len(batch), exc_info=error)
        if is_fatal(error):
            self._poison(f"device or engine failure: {describe(error)}", error)
        try:
            culprits = find_culprits(batch, error, self._probe)
        except Exception as e:  # fatal, from a re-run
            self._poison(f"device or engine failure: {describe(e)}", e)
        parents = {self._parent_of(s.request_id) for s in batch}
        failed = {self._parent_of(s.request_id): e for s, e in culprits}
        if len(parents) > 1 and failed.keys() == parents:
            self._poison(f"every request of a step failed on its own: {describe(error)}", error)
        self.runner.forget_generators([s.request_id for s in batch])
        outputs = [out for p, e in failed.items() if p and (out := self._fail(p, e))]
        rolled = self.scheduler.roll_back(sched)
        self._count_rollbacks(rolled, error)
        if self.tracer is not None:
            for request in rolled:
                self.tracer.event("preempted", request.request_id, cause="fault")
        return outputs

    def _probe(self, batch: list[ScheduledRequest]) -> None:
        self._execute(SchedulerOutput(scheduled=batch))

    def _parent_of(self, child_id: str) -> str | None:
        """The request a scheduled request is a sample of, or the beam search it is a beam of."""
        if (group := self.scheduler.beams.group_of(child_id)) is not None:
            return group.group_id
        op = self.output_processor
        for parent in (child_id, child_id.rpartition("#")[0]):
            if op.has(parent) and child_id in op.child_ids(parent):
                return parent
        return None

    def _fail(self, request_id: str, error: Exception) -> RequestOutput | None:
        """Abort a request (all its samples), recording its error."""
        logger.error("request %s failed in the model runner", request_id, exc_info=error)
        message = f"request failed in the model runner: {describe(error)}"
        self.request_errors[request_id] = RequestFailedError(message)
        return self.abort_request(request_id)

    def _count_rollbacks(self, rolled: list[Request], error: Exception) -> None:
        """Poison when a request keeps being rolled back with no token in between."""
        for request in rolled:
            n = request.num_output_tokens
            at, times = self._rollbacks.get(request.request_id, (-1, 0))
            times = times + 1 if at == n else 1
            if times >= MAX_ROLLBACKS:
                self._poison(f"a step failed {times} times in a row: {describe(error)}", error)
            self._rollbacks[request.request_id] = (n, times)
        for request_id in [r for r in self._rollbacks if r not in self.scheduler.requests]:
            del self._rollbacks[request_id]

    def _poison(self, reason: str, cause: BaseException) -> NoReturn:
        self.dead_reason = reason
        self._execute = self._refuse  # every later step raises at once
        logger.critical("the engine is poisoned: %s", reason)
        raise EngineDeadError(reason) from cause

    def _refuse(self, sched: SchedulerOutput) -> RunnerOutput:
        raise EngineDeadError(self.dead_reason or "the engine is poisoned")

    def _record_finished(self, now: float) -> None:
        counted: set[str] = set()  # requests whose n samples have all finished
        for request in self.scheduler.just_finished:
            if self.metrics is not None:
                n = request.sampling_params.n
                parent = request.request_id.rsplit("#", 1)[0] if n > 1 else request.request_id
                siblings = [f"{parent}#{i}" for i in range(n)] if n > 1 else []
                last = parent not in counted and not any(
                    s in self.scheduler.requests for s in siblings
                )
                counted.add(parent)
                self.metrics.request_finished(request, now, last)
            if self.tracer is not None:
                self.tracer.event(
                    "finished",
                    request.request_id,
                    reason=request.status.finish_reason,
                    output_tokens=request.num_output_tokens,
                )
        self.scheduler.just_finished.clear()

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
            kv_blocks_freed_by_window=kv.num_window_freed,
            kv_blocks_peak=kv.peak_used_blocks,
            **self.config.kv_cache_report(),
            spec_decode=None if s.spec is None else s.spec.counters(),
            lora=lora_requests_info(s.running, s.waiting, self.config.lora),
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
