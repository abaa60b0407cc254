"""Continuous-batching scheduler (vLLM v1 style): one token budget per step, no phases.

Each step, running requests are served first (a decode needs one token, an unfinished prefill
its next chunk), then waiting ones are admitted in arrival order while the budget, the
sequence cap and the KV pool allow. When blocks run out the newest running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
from its prompt *and* the output it already has. On a model whose every layer has a sliding
window, a request's blocks that fall out of the window are freed as it goes (kv_cache_manager),
so admission and preemption count only the blocks it still holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.beam_group import BeamGroup, BeamGroups, resume_group, schedule_group
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.step_io import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from pagedllm.request import Request, RequestStatus

__all__ = ["RunnerOutput", "ScheduledRequest", "Scheduler", "SchedulerOutput", "TokenLogprobs"]


class Drafter(Protocol):
    """Speculative decoding as the scheduler drives it (core/spec_decode.py's `SpecDecoder`)."""

    def draft(self, request: Request, budget: int, scheduler: Scheduler) -> list[int]: ...

    def verified(
        self, request: Request, num_drafted: int, num_accepted: int, kv: KVCacheManager
    ) -> None: ...

    def counters(self) -> tuple[int, int, int, tuple[int, ...]]: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig) -> None:
        assert cache.num_kv_blocks is not None
        self.config = config
        self.kv = KVCacheManager(
            cache.num_kv_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.sliding_window,
            cache.num_state_slots,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # beam searches: a group's beams are side by side in `running` / `waiting`
        self.beams = BeamGroups(self.kv)
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        # finished since the engine last took them (for its metrics)
        self.just_finished: list[Request] = []
        self.spec: Drafter | None = None  # speculative decoding (set by the engine)

    # --- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_tokens, request.sampling_params.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_beam_group(self, group: BeamGroup) -> None:
        width, cfg = group.params.beam_width, self.config
        if self.kv.states is not None:  # a beam would need its parent's recurrent state
            raise ValueError("beam search is not supported on hybrid (linear-attention) models")
        if width > min(cfg.max_num_seqs, cfg.max_num_batched_tokens):
            raise ValueError(f"beam_width {width} exceeds max_num_seqs or max_num_batched_tokens")
        self.check_fits(len(group.prompt_token_ids), group.params.max_tokens, width)
        self.beams.add(group)
        self.add_request(group.requests[0])

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None, num_seqs: int = 1) -> None:
        """Reject what could never be served: empty prompts, prompts or generations beyond the
        context length, and requests that would not fit the whole KV pool on their own."""
        max_len = self.config.max_model_len
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= max_len:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens; the model's context is "
                f"{max_len} tokens, with at least one for output"
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > max_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                f"the model's context of {max_len} tokens"
            )
        # the last sampled token is never fed back: its KV is never written; with a window a
        # request holds at most the blocks of one chunk and the window before it
        total = min(max_len, num_prompt_tokens + (max_tokens or max_len)) - 1
        # a beam group's sequences may have to be recomputed side by side, unshared
        needed = num_seqs * self.kv.max_blocks_held(total, self.config.max_num_batched_tokens)
        if needed > self.kv.pool.num_blocks:
            what = "a request" if num_seqs == 1 else f"{num_seqs} beams"
            raise ValueError(
                f"{what} of {total + 1} tokens needs {needed} KV blocks; the pool has "
                f"{self.kv.pool.num_blocks}"
            )

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its blocks at once."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- the step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        out.block_copies = self.kv.take_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.beams.group_of(request.request_id) is not None:
                unit = self.beams.unit(request)
                budget, scheduled = schedule_group(self, out, unit, budget)
                if not scheduled:
                    return budget
                i += len(unit)
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            spec = self.spec if num_new == 1 else None  # drafts follow a decode token only
            draft = spec.draft(request, budget - 1, self) if spec else []
            while not self.kv.allocate_slots(request, num_new, num_lookahead=len(draft)):
                if request in self._preempt_newest(out):
                    return budget
            self._schedule(out, request, num_new, draft)
            budget -= num_new + len(draft)
            i += 1
        return budget

    def _preempt_newest(self, out: SchedulerOutput) -> list[Request]:
        """Preempt the newest running request, or the newest beam group as a whole."""
        unit = self.beams.unit(self.running[-1])
        del self.running[-len(unit) :]
        for victim in unit:
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
        self.waiting.extendleft(reversed(unit))
        if (group := self.beams.group_of(unit[0].request_id)) is not None:
            self.beams.reset(group)
        return unit

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if len(self.running) + self.beams.num_seqs(request) > self.config.max_num_seqs:
                return
            if len(unit := self.beams.unit(request)) > 1:  # a preempted beam group
                if not resume_group(self, out, unit, budget):
                    return
                budget -= sum(s.num_tokens for s in out.scheduled[-len(unit) :])
                continue
            if not self._lora_slot_free(request):  # it waits for an adapter slot
                return
            # prompt logprobs need every prompt position computed: no prefix hits
            wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
            cached = [] if wants_prompt_logprobs else self.kv.get_computed_blocks(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = budget
            if not self.kv.allocate_slots(request, num_new, cached):
                return
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:  # first admission, not a resumption
                request.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(request.num_tokens, num_cached)
                out.admitted.append(request)
            else:
                out.resumed_ids.append(request.request_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            self.running.append(request)
            self._schedule(out, request, num_new)
            budget -= num_new

    def _lora_slot_free(self, request: Request) -> bool:
        """Its adapter runs already, or fewer than max_loras adapters do."""
        if (lora := request.lora_request) is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return lora.lora_int_id in running or len(running) < self.config.max_loras

    def _schedule(
        self, out: SchedulerOutput, request: Request, num_new: int, draft: Sequence[int] = ()
    ) -> None:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new  # drafts count once accepted
        out.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=[*request.all_token_ids[start : start + num_new], *draft],
                start_pos=start,
                block_ids=self.kv.block_ids(request.request_id),
                sample=request.num_computed_tokens == request.num_tokens,
                params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                seed=request.seed,
                state_slot=self.kv.state_slot(request.request_id),
                lora_request=request.lora_request,
                spec_token_ids=[*draft],
            )
        )

    def _preempt(self, request: Request) -> None:
        """Free a request's blocks; the caller puts it back at the front of the queue."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Append sampled tokens, finish what must stop; return the requests that changed."""
        changed = []
        ready: list[BeamGroup] = []
        for s in out.scheduled:
            request = self.requests.get(s.request_id)
            # aborted (or preempted and rescheduled) since the step was scheduled
            if request is None or not s.sample or request.status != RequestStatus.RUNNING:
                continue
            token_id = result.sampled_token_ids[s.request_id]
            if (group := self.beams.group_of(s.request_id)) is not None:
                group.record(s.request_id, token_id, result.logprobs.get(s.request_id))
                if group.ready and group not in ready:
                    ready.append(group)
                continue
            more = result.spec_token_ids.get(s.request_id, [])
            for i, token in enumerate([token_id, *more]):
                request.num_computed_tokens += i > 0  # an accepted draft: its KV is kept
                request.append_output_token(token)
                if (status := self._stop_status(request, token)) is not None:
                    break
            if s.spec_token_ids and self.spec is not None:
                self.spec.verified(request, len(s.spec_token_ids), len(more), self.kv)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            changed.append(request)
        for group in ready:
            self._advance(group)
        return changed

    def _advance(self, group: BeamGroup) -> None:
        """A beam step: the group's old beams give way to their children, in place."""
        at = self.running.index(group.beams[0].request)
        old, new = self.beams.advance(group)
        assert self.running[at : at + len(old)] == old, "a group's beams are not side by side"
        self.running[at : at + len(old)] = new
        for request in old:
            del self.requests[request.request_id]
            self._finished_ids.append(request.request_id)
        for request in new:
            self.requests[request.request_id] = request

    def abort_beam_group(self, group_id: str) -> bool:
        """Drop a beam search wherever it is and free its blocks at once."""
        if (group := self.beams.groups.get(group_id)) is not None:
            self.finish_requests(
                [r.request_id for r in group.requests], RequestStatus.FINISHED_ABORTED
            )
            self.beams.abort(group)
        return group is not None

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        # a grammar allows EOS only where its output may end, and then it ends it
        if params.structured_outputs is not None and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        # the sampler masks these ids until min_tokens outputs exist; this is the backstop
        if request.num_output_tokens > params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self.just_finished.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests for a reason found outside the scheduler (e.g. a stop string)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def roll_back(self, out: SchedulerOutput) -> list[Request]:
        """Undo a step that failed to execute (its update never came): every request it
        scheduled that is still running is recomputed from its prompt and output, as after a
        preemption (not counted as one), in its order at the front of the queue. The prefix
        cache is dropped: blocks registered for the step may hold partial or no KV. Returns
        the requests rolled back."""
        self.kv.pool.reset_prefix_cache()
        rolled: list[Request] = []  # a beam group as a whole, its beams side by side
        for s in out.scheduled:
            r = self.requests.get(s.request_id)
            if r is not None and r.status == RequestStatus.RUNNING and r not in rolled:
                rolled += self.beams.unit(r)
        for request in reversed(rolled):
            self.running.remove(request)
            self.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self.waiting.appendleft(request)
            if (group := self.beams.group_of(request.request_id)) is not None:
                self.beams.reset(group)
        return rolled

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        assert set(self.kv.req_blocks) <= {r.request_id for r in self.running}, (
            "a request that is not running holds blocks"
        )
        assert len(self.running) + len(self.waiting) == len(self.requests)
