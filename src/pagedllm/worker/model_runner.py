"""Runs one scheduled step: flattens the batch, runs the model over the paged KV cache and
samples the next token of every request whose chunk reached its end."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.layers.attention import StepInputs
from pagedllm.layers.bitmask import allow_only_, apply_token_bitmask_, ban_
from pagedllm.layers.sampler import (
    Sampler,
    SampleRequest,
    SamplingMetadata,
    bad_word_bans,
    prompt_logprobs,
)
from pagedllm.lora.slots import SlotTable
from pagedllm.worker import rejection, spec_verify
from pagedllm.worker.draft_runner import DraftRunner
from pagedllm.worker.executor import ShardExecutor, StepPlan, use_device
from pagedllm.worker.tp_worker import TPWorkers

if TYPE_CHECKING:  # llguidance is imported only once a request is constrained
    from pagedllm.structured.matchers import GrammarMatchers, Masks


class ModelRunner(ShardExecutor):
    """Rank 0: plans each step, runs it (on every rank of a tensor-parallel engine: the
    plan is broadcast to the workers first) and samples from the gathered logits."""

    def __init__(self, config: EngineConfig) -> None:
        world = config.tensor_parallel_size
        # the workers start first: they load their shards while this rank loads its own
        self.workers = TPWorkers(config) if world > 1 else None
        try:
            tp = None if self.workers is None else self.workers.connect()
            super().__init__(config, 0, world, tp)
            if self.workers is not None:
                self.workers.wait_ready()
            self.capture_graphs()
        except BaseException:
            if self.workers is not None:
                self.workers.stop(polite=False)  # they may be anywhere in their start
            raise
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        # structured outputs: set by the engine with the first constrained request
        self.grammars: GrammarMatchers | None = None
        # which LoRA adapter holds which slot of every rank's pool (lora/slots.py)
        self.lora_table = None if config.lora is None else SlotTable(config.lora.max_loras)
        # speculative decoding with a draft model: its proposals (worker/draft_runner.py)
        spec = config.speculative
        drafts = spec is not None and spec.method == "draft_model"
        self.drafter = DraftRunner(config, self) if drafts else None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel worker died); None if it can."""
        return None if self.workers is None else self.workers.dead_reason

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any); the runner cannot step afterwards."""
        if self.workers is not None:
            self.workers.stop()

    def plan(self, batch: list[ScheduledRequest]) -> StepPlan:
        """`batch` must hold the decodes first (see `order_batch`)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens = []
        logits_indices: list[int] = []
        max_blocks = max(len(s.block_ids) for s in batch)
        tables: list[list[int]] = []
        for s in batch:
            end = s.start_pos + s.num_tokens
            input_ids += s.token_ids
            pos = range(s.start_pos, end)
            positions += pos
            table = s.block_ids
            slots += [table[p // bs] * bs + p % bs for p in pos]
            # a drafting request's k + 1 positions are k + 1 decode rows, each attending to
            # the cache up to its own position (the backends write every row's KV first)
            padded = table + [0] * (max_blocks - len(table))
            for context in range(s.start_pos + 1, end + 1) if s.spec_token_ids else [end]:
                query_start_loc.append(len(input_ids) - (end - context))
                context_lens.append(context)
                tables.append(padded)
            if s.sample:  # the last token's logits, and each draft token's before it
                logits_indices += range(len(input_ids) - 1 - len(s.spec_token_ids), len(input_ids))
        # decodes first: single tokens and drafts' rows, then prefill chunks (order_batch)
        chunks = sum(1 for s in batch if not is_decode(s))
        num_decodes = len(context_lens) - chunks
        plan = StepPlan(
            input_ids,
            positions,
            slots,
            query_start_loc,
            context_lens,
            tables,
            num_decodes,
            logits_indices,
        )
        if self.states:  # a hybrid model's linear-attention state slots
            plan.state_slots = [s.state_slot for s in batch]
            plan.state_continues = [s.start_pos > 0 for s in batch]
        return plan

    def prepare_inputs(self, batch: list[ScheduledRequest]) -> StepInputs:
        """`batch`'s step as tensors (decodes first)."""
        return self.inputs(self.plan(batch))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        use_device(self.device)  # the engine's step thread starts on cuda:0
        for request_id in sched.finished_ids:
            self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(sched.finished_ids)
        batch = order_batch(sched.scheduled)
        drafts: dict[str, rejection.Draft] = {}
        if self.drafter is not None:  # the drafts first: the grammars' masks read them
            self.drafter.forget(sched.finished_ids)
            drafts = self.drafter.propose(batch, sched.block_copies)
        sampled = [s for s in batch if s.sample]
        # the grammars' next-token masks are filled on their own thread during the forward pass
        fill = self._fill_masks(sampled)
        try:
            logits, spans = self._forward(batch, sched.block_copies)
        finally:  # the mask thread is done with this step's requests before the step ends
            masks = None if fill is None else fill.result()
        out = RunnerOutput()
        offset = spec_verify.num_rows(sampled)
        if sampled:
            self._sample(logits[:offset], sampled, out, masks, drafts)
        for span in spans:
            s = span.request
            scored = prompt_logprobs(
                logits[offset : offset + span.count],
                s.prompt_token_ids[span.first_pos : span.first_pos + span.count],
                span.num_top,
            )
            out.prompt_logprobs[s.request_id] = (span.first_pos, scored)
            offset += span.count
        return out

    def _forward(
        self, batch: list[ScheduledRequest], block_copies: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, list[_PromptLogprobSpan]]:
        """The logits of the sampled rows, then of the prompt positions scored for prompt
        log-probs (the spans). The KV blocks of `block_copies` are copied first."""
        plan = self.plan(batch)
        plan.block_copies = block_copies
        if self.lora_table is not None:
            plan.lora_loads, plan.lora_slots = self.lora_table.plan(batch)
        spans = _prompt_logprob_spans(batch)
        if spans:  # prompt positions' logits too: no CUDA graph
            plan.logits_indices += [
                i for span in spans for i in range(span.flat_start, span.flat_start + span.count)
            ]
            plan.eager = True
        if self.workers is None:
            return self.forward(plan), spans
        return self.workers.run(lambda: self.forward(plan), plan), spans

    def _fill_masks(self, sampled: list[ScheduledRequest]) -> Future[Masks | None] | None:
        if self.grammars is None or not any(s.params.structured_outputs for s in sampled):
            return None
        return self.grammars.submit(sampled)

    def _sample(
        self,
        logits: torch.Tensor,
        batch: list[ScheduledRequest],
        out: RunnerOutput,
        masks: Masks | None,
        drafts: dict[str, rejection.Draft],
    ) -> None:
        # one row per request, and one per draft token of a speculating one
        verify = list(spec_verify.verify_rows(batch))
        rows = [
            # a draft model's sampled drafts draw from their own streams (worker/rejection.py)
            self.sample_row(s, outputs, None if s.request_id in drafts else self._generator(s))
            for s, outputs in ((batch[b], outputs) for b, outputs in verify)
        ]
        if masks is not None:  # before the sampler: log-probs are of the masked logits
            self._constrain(logits, rows, masks)
            out.failed.update(masks.failed)
        left = batch
        if drafts:  # a draft model's sampled drafts: the rejection rule
            logits, rows, left = rejection.verify_drafts(logits, rows, batch, drafts, out)
        if rows:
            meta = SamplingMetadata.build(rows, logits.shape[1], self.device)
            states = spec_verify.generator_states(left, self._generators)
            result = self.sampler(logits, rows, meta)
            spec_verify.accept(left, result, out, states, self._generators)
        if self.drafter is not None:
            self.drafter.verified(batch, out)

    def sample_row(
        self, s: ScheduledRequest, outputs: list[int], generator: torch.Generator | None
    ) -> SampleRequest:
        """A row to sample for `s` after `outputs` (its output tokens, and drafts)."""
        early = len(outputs) < s.params.min_tokens
        stop_ids = self._stop_ids(s) if early else ()
        return SampleRequest(s.params, s.prompt_token_ids, outputs, generator, stop_ids)

    def _constrain(self, logits: torch.Tensor, rows: list[SampleRequest], masks: Masks) -> None:
        """The grammars' masks on their rows. For those rows min_tokens' and bad words' bans
        and allowed_token_ids go through the mask, which they must not empty: the grammar wins
        (a complete grammar allows only EOS). EOS ends a constrained request whatever
        `ignore_eos` says, so min_tokens holds it back there. (A logit bias is added later, by
        the sampler: finite, it cannot empty the mask.)"""
        constrained = [i for i, r in enumerate(rows) if r.params.structured_outputs]
        eos = self.config.model.eos_token_ids
        for i in constrained:
            r = rows[i]
            early = len(r.output_token_ids) < r.params.min_tokens
            bans = [*eos, *r.params.stop_token_ids] if early else []
            bans += [t for _, t in bad_word_bans([r])]
            if bans:
                ban_(masks.bitmask, i, bans)
            if r.params.allowed_token_ids:
                allow_only_(masks.bitmask, i, r.params.allowed_token_ids)
            r.stop_ids, r.in_mask = (), True
        apply_token_bitmask_(logits, masks.bitmask, constrained)

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        if s.seed is None:
            return None
        gen = self._generators.get(s.request_id)
        if gen is None:
            gen = self._generators[s.request_id] = torch.Generator(self.device).manual_seed(s.seed)
            # NOTE: a seeded stream advances by one draw per sampled token (the sampler's
            # `_uniforms`); one dropped after a failed step is rebuilt by replaying its draws
            for _ in range(len(s.output_token_ids)):
                torch.rand(1, generator=gen, device=gen.device)
        return gen

    def forget_generators(self, request_ids: list[str]) -> None:
        """Drop these requests' random streams (a failed step, or re-runs of parts of it, may
        have advanced them); each is rebuilt where it stood when next used."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def _stop_ids(self, s: ScheduledRequest) -> list[int]:
        eos = () if s.params.ignore_eos else self.config.model.eos_token_ids
        return [*eos, *s.params.stop_token_ids]


@dataclass
class _PromptLogprobSpan:
    request: ScheduledRequest
    flat_start: int  # first token of the span in the flat batch
    count: int  # tokens whose next token is a prompt token
    first_pos: int  # position of the first prompt token scored
    num_top: int


def _prompt_logprob_spans(
    batch: list[ScheduledRequest],
) -> list[_PromptLogprobSpan]:
    spans, flat_start = [], 0
    for s in batch:
        num_top = s.params.prompt_logprobs
        # logits at position p score prompt token p + 1
        count = min(s.start_pos + s.num_tokens, len(s.prompt_token_ids) - 1) - s.start_pos
        if num_top is not None and count > 0:
            spans.append(_PromptLogprobSpan(s, flat_start, count, s.start_pos + 1, num_top))
        flat_start += s.num_tokens
    return spans


def is_decode(s: ScheduledRequest) -> bool:
    """One new token, or one and its draft (verified as decode rows)."""
    return s.num_tokens - len(s.spec_token_ids) == 1


def order_batch(batch: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes (one new token, or one and its draft) first, prefill chunks after, as the
    attention backends expect."""
    return sorted(batch, key=lambda s: not is_decode(s))
