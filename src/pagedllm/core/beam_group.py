"""Beam search inside the engine: a group of beams that share KV blocks.

A group starts as one sequence, its prompt (prefilled as any request: chunked, with prefix
hits). Every step each live beam is one scheduled sequence (`Request`) that samples with
`2 * width` log-probs; once all of them have reported, `BeamGroups.advance` applies vLLM's rule
(`pagedllm.beam_search.select_candidates`) and forks the chosen parents: a child's block table
is its parent's, every block shared by reference count (`KVCacheManager.fork`). A partly filled
last block is copied only when a beam writes into it while another still holds it (copy on
write, `KVCacheManager.allocate_slots`). Parents are freed right after their children fork, so
the blocks of pruned beams go back to the pool at once.

The scheduler keeps a group's beams side by side in `running` / `waiting` and moves them as
one: they are scheduled together, preempted together (then each is recomputed from its prompt
and output: prefix caching shares their common full blocks again) and admitted together.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.beam_hf import Hypotheses, hf_num_candidates, hf_select
from pagedllm.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    Candidate,
    get_beam_search_score,
    select_candidates,
)
from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.step_io import SchedulerOutput
from pagedllm.model_config import ModelConfig
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

TokenLogprobs = tuple[list[int], list[float], float, int]


@dataclass(eq=False)
class Beam:
    request: Request
    cum_logprob: float = 0.0
    # one dict per output token: the candidates its parent proposed (token -> log-prob)
    logprobs: list[dict[int, float]] = field(default_factory=list)

    def sequence(self) -> BeamSearchSequence:
        return BeamSearchSequence(
            list(self.request.all_token_ids), list(self.logprobs), self.cum_logprob
        )


@dataclass(eq=False)
class BeamGroup:
    group_id: str
    params: BeamSearchParams
    prompt_token_ids: list[int]
    # EOS ids that end a hypothesis (empty with ignore_eos)
    eos_token_ids: frozenset[int]
    beams: list[Beam]  # live, best first
    completed: list[BeamSearchSequence] = field(default_factory=list)
    # this step's proposals, beam request id -> (token, log-prob) candidates
    pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    num_steps: int = 0
    finished: bool = False
    # HF's finished hypotheses and stop test, with `params.early_stopping` (else vLLM's rule)
    hyps: Hypotheses | None = None
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1), repr=False)

    @staticmethod
    def create(
        group_id: str,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        model: ModelConfig,
        max_logprobs: int,
        arrival_time: float = 0.0,
    ) -> BeamGroup:
        """One root beam over the prompt; its sampling asks for the candidates' log-probs.
        Raises ValueError for token ids outside the vocabulary or too wide a beam."""
        prompt = [int(t) for t in prompt_token_ids]
        eos = frozenset() if params.ignore_eos else frozenset(model.eos_token_ids)
        hyps, num_candidates = None, params.num_candidates
        if params.early_stopping is not None:  # HF's rule (`pagedllm.beam_hf`)
            num_candidates = hf_num_candidates(params.beam_width, len(eos))
            hyps = Hypotheses(
                params.beam_width, params.length_penalty, params.early_stopping, params.max_tokens
            )
        if num_candidates > max_logprobs:  # each beam's candidates are log-probs
            per_beam = num_candidates // params.beam_width
            raise ValueError(f"beam_width must be at most {max_logprobs // per_beam}")
        if any(not 0 <= t < model.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {model.vocab_size})")
        sp = SamplingParams(
            temperature=params.temperature,
            logprobs=num_candidates,
            max_tokens=params.max_tokens,
            ignore_eos=True,  # the group decides what ends, not the scheduler's stop checks
            detokenize=False,
        )
        root = Request(f"{group_id}#beam0", prompt, sp, eos, arrival_time)
        return BeamGroup(group_id, params, prompt, eos, [Beam(root)], hyps=hyps)

    @property
    def requests(self) -> list[Request]:
        return [b.request for b in self.beams]

    @property
    def ready(self) -> bool:
        """Every live beam has proposed this step's candidates."""
        return len(self.pending) == len(self.beams)

    def select(
        self, cum_logprobs: list[float], proposals: list[list[tuple[int, float]]]
    ) -> tuple[list[Candidate], list[Candidate]]:
        """This step's (next live beams, candidates that finish), by the group's rule."""
        width, eos = self.params.beam_width, self.eos_token_ids
        if self.hyps is None:
            return select_candidates(cum_logprobs, proposals, width, eos)
        last = self.num_steps + 1 >= self.params.max_tokens
        return hf_select(cum_logprobs, proposals, width, eos, last)

    def end_step(self, finished: list[BeamSearchSequence], chosen: list[Candidate]) -> bool:
        """Keep this step's finished hypotheses; whether the search ends now."""
        self.num_steps += 1
        if self.hyps is None:  # vLLM's rule: every one, no early stop
            self.completed.extend(finished)
            return self.num_steps >= self.params.max_tokens or not chosen
        if self.hyps.accepting():
            self.hyps.add([(seq, self.num_steps) for seq in finished])
        return self.hyps.done(chosen[0][2] if chosen else None, self.num_steps)

    def record(self, request_id: str, token_id: int, lp: TokenLogprobs | None) -> None:
        """A beam's proposals: its top `2 * width` tokens, and the sampled one (vLLM's
        logprobs dict holds it too: with a temperature it may be outside the top)."""
        assert lp is not None, "a beam sampled without log-probs"
        top_ids, top_vals, chosen, _ = lp
        cands = list(zip(top_ids, top_vals, strict=True))
        if token_id not in top_ids:
            cands.append((token_id, chosen))
        self.pending[request_id] = cands

    def live_sequences(self) -> list[BeamSearchSequence]:
        """The live beams so far, best first (what a streaming interface sends each step)."""
        return [b.sequence() for b in self.beams]

    def best(self) -> list[BeamSearchSequence]:
        """The final ranking: finished and live hypotheses by vLLM's score, `width` best (HF's
        rule: its finished hypotheses)."""
        if self.hyps is not None:
            return self.hyps.sequences()
        live = self.live_sequences()
        for s in live:
            s.finish_reason = "length"
        eos, lp = self.eos_token_ids, self.params.length_penalty
        ranked = sorted(
            self.completed + live,
            key=lambda s: get_beam_search_score(s.tokens, s.cum_logprob, eos, lp),
            reverse=True,
        )
        return ranked[: self.params.beam_width]


class BeamGroups:
    """The scheduler's beam groups: which group a sequence belongs to, and the step rule."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.groups: dict[str, BeamGroup] = {}
        self._of: dict[str, BeamGroup] = {}  # beam request id -> its group
        self.finished: list[BeamGroup] = []  # finished since the engine last took them

    def add(self, group: BeamGroup) -> None:
        if group.group_id in self.groups:
            raise ValueError(f"request id {group.group_id!r} is already in use")
        self.groups[group.group_id] = group
        for request in group.requests:
            self._of[request.request_id] = group

    def group_of(self, request_id: str) -> BeamGroup | None:
        return self._of.get(request_id)

    def unit(self, request: Request) -> list[Request]:
        """What moves as one through the scheduler: a group's beams, or the request alone."""
        group = self._of.get(request.request_id)
        return [request] if group is None else group.requests

    def num_seqs(self, request: Request) -> int:
        """Sequences a request will need once admitted: a group's width."""
        group = self._of.get(request.request_id)
        return 1 if group is None else max(group.params.beam_width, len(group.beams))

    def reset(self, group: BeamGroup) -> None:
        """The group was preempted: its proposals of this step are recomputed."""
        group.pending.clear()

    def advance(self, group: BeamGroup) -> tuple[list[Request], list[Request]]:
        """One step of the rule for a ready group: fork the chosen parents, free the old
        beams. Returns (old beams, new beams); no new ones once the group has finished."""
        old = group.beams
        proposals = [group.pending[b.request.request_id] for b in old]
        group.pending = {}
        chosen, ended = group.select([b.cum_logprob for b in old], proposals)
        finished = []
        for parent, token, cum in ended:
            seq = _extend(old[parent], proposals[parent], token, cum).sequence()
            seq.tokens.append(token)
            seq.finish_reason = "stop" if token in group.eos_token_ids else "length"
            finished.append(seq)
        last = group.end_step(finished, chosen)
        new: list[Beam] = []
        for parent, token, cum in chosen:
            beam = _extend(old[parent], proposals[parent], token, cum)
            if last:  # its token is never fed back: no request, no blocks
                beam.request = _child(old[parent].request, f"{group.group_id}#final", token)
            else:
                beam.request = _child(old[parent].request, self._next_id(group), token)
                self.kv.fork(old[parent].request, beam.request)
                self._of[beam.request.request_id] = group
            new.append(beam)
        for beam in old:
            self.kv.free(beam.request)
            beam.request.status = RequestStatus.FINISHED_STOPPED
            del self._of[beam.request.request_id]
        group.beams = new
        if last:
            group.finished = True
            del self.groups[group.group_id]
            self.finished.append(group)
            return [b.request for b in old], []
        return [b.request for b in old], group.requests

    def take_outputs(
        self, decode: Callable[[list[int]], str]
    ) -> list[tuple[str, BeamSearchOutput]]:
        """The groups finished since the last call: (group id, its best sequences, texts
        decoded)."""
        groups, self.finished = self.finished, []
        outputs = []
        for group in groups:
            sequences = group.best()
            for seq in sequences:
                seq.text = decode(seq.tokens)
            outputs.append((group.group_id, BeamSearchOutput(sequences)))
        return outputs

    def abort(self, group: BeamGroup) -> None:
        """Forget a group whose beams the scheduler has just freed."""
        for request in group.requests:
            self._of.pop(request.request_id, None)
        self.groups.pop(group.group_id, None)

    @staticmethod
    def _next_id(group: BeamGroup) -> str:
        return f"{group.group_id}#beam{next(group._ids)}"


class GroupScheduler(Protocol):
    """What `schedule_group` / `resume_group` use of the scheduler (core/scheduler.py's
    `Scheduler`, which imports this module): its queues, its KV cache, its own steps."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: deque[Request]
    running: list[Request]

    def _preempt_newest(self, out: SchedulerOutput) -> list[Request]: ...

    def _schedule(
        self, out: SchedulerOutput, request: Request, num_new: int, draft: Sequence[int] = ()
    ) -> None: ...


def schedule_group(
    sched: GroupScheduler, out: SchedulerOutput, beams: list[Request], budget: int
) -> tuple[int, bool]:
    """A group's beams in turn; one that has proposed its candidates waits (0 tokens).
    Its blocks (copies included) are counted for all beams before any is allocated."""
    plan = []
    for request in beams:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        plan.append((request, num_new))
        budget -= num_new
    while sched.kv.num_blocks_needed(plan) > sched.kv.pool.num_free_blocks:
        if beams[0] in sched._preempt_newest(out):
            return budget + sum(n for _, n in plan), False
    for request, num_new in plan:
        if num_new:
            assert sched.kv.allocate_slots(request, num_new)
            sched._schedule(out, request, num_new)
    return budget, True


def resume_group(
    sched: GroupScheduler, out: SchedulerOutput, beams: list[Request], budget: int
) -> bool:
    """Admit a preempted group's beams together, or none of them (`plan_resume`)."""
    ends = plan_resume(sched.kv, beams, budget, sched.config.enable_chunked_prefill)
    if ends is None:
        return False
    bs = sched.kv.block_size
    for beam, end in zip(beams, ends, strict=True):
        sched.waiting.popleft()
        # hits on the beams just admitted too (at least one token left to compute)
        cached = sched.kv.get_computed_blocks(beam)[: (end - 1) // bs]
        assert sched.kv.allocate_slots(beam, end - len(cached) * bs, cached)
        out.resumed_ids.append(beam.request_id)
        beam.status = RequestStatus.RUNNING
        beam.num_computed_tokens = len(cached) * bs
        sched.running.append(beam)
        sched._schedule(out, beam, end - beam.num_computed_tokens)
    return True


def plan_resume(
    kv: KVCacheManager, beams: list[Request], budget: int, chunked: bool
) -> list[int] | None:
    """Where each of a preempted group's beams gets to in its first step back (each is
    recomputed: its prompt and output, prefix hits sharing their common full blocks), or None
    if they cannot all be admitted now. Conservative: the hits on the beams admitted before a
    beam are not counted."""
    bs, ends = kv.block_size, []
    need = 0
    idle: set[int] = set()  # cached blocks nobody holds: a hit takes them from the free queue
    for k, beam in enumerate(beams):
        cached = kv.get_computed_blocks(beam)
        remaining = beam.num_tokens - len(cached) * bs
        num_new = min(remaining, budget - (len(beams) - 1 - k))  # >= 1 token for the rest
        if num_new < 1 or (num_new < remaining and not chunked):
            return None
        budget -= num_new
        ends.append(len(cached) * bs + num_new)
        need += kv.num_blocks_for(ends[-1]) - len(cached)
        idle |= {b.block_id for b in cached if b is not None and b.ref_cnt == 0}
    return ends if need + len(idle) <= kv.pool.num_free_blocks else None


def _extend(parent: Beam, proposals: list[tuple[int, float]], token: int, cum: float) -> Beam:
    # its request stays the parent's until the caller forks a child (its tokens lack `token`)
    return Beam(parent.request, cum, [*parent.logprobs, dict(proposals)])


def _child(parent: Request, request_id: str, token: int) -> Request:
    """A copy of `parent` (prompt, output, computed tokens, block hashes) plus `token`."""
    child = Request(
        request_id,
        parent.prompt_token_ids,
        parent.sampling_params,
        parent.eos_token_ids,
        parent.arrival_time,
        status=RequestStatus.RUNNING,
        output_token_ids=list(parent.output_token_ids),
        num_computed_tokens=parent.num_computed_tokens,
        num_cached_tokens=parent.num_cached_tokens,
        block_hashes=list(parent.block_hashes),
    )
    child.all_token_ids = list(parent.all_token_ids)
    child.append_output_token(token)
    return child
