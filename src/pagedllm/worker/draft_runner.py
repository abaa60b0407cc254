"""Speculative decoding with a draft model, the proposals: before the target's forward pass,
the draft model fills in the k placeholder draft tokens the scheduler gave each speculating
request (`core.spec_decode`), one cheap forward pass per draft position, batched over the
requests.

The draft's KV cache lies in the target's blocks: its own tensors, with as many blocks of the
same size, indexed by the same block tables. So it needs no allocator of its own: the
scheduler's blocks are the draft's too, freed with the request's on finish, abort and
preemption, trimmed with its rejected tail, and a prefix-cache hit brings the draft's KV of
the block along. What the draft must know is how far each request's draft KV is right:
`computed[request]` positions. The first pass of a step (`_catch_up`) computes, for a request
that drafts, the positions from there to its last token (its accepted drafts' and bonus
token's, and anything it decoded without drafting meanwhile), and for a prefill chunk the
chunk itself (so that prompts' blocks hold the draft's KV when they are cached); a plain
decode is skipped (the draft catches up when the request drafts again). The pass samples
d_1 for each drafting request; then passes 2..k feed d_{i-1} at position p + i - 1 and sample
d_i: decodes only (on the CPU the one-call C++ decoder). The draft's KV for d_1..d_{k-1} is
right only as far as they are accepted (`verified`); rejected positions are overwritten later.

A wrong draft KV (a cached block whose draft KV a lagging request never wrote) can only make
drafts worse, never outputs: every draft is verified by the target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from pagedllm.config import EngineConfig, ModelConfig, check_quantization
from pagedllm.core.scheduler import RunnerOutput, ScheduledRequest
from pagedllm.layers.sampler import SampleRequest, SamplingMetadata
from pagedllm.worker.executor import ShardExecutor, StepPlan, copy_blocks
from pagedllm.worker.rejection import Draft, draw, sampling_probs, step_generator, uniforms


class TargetRunner(Protocol):
    """What the draft reads of the target's runner (worker/model_runner.py `ModelRunner`)."""

    def plan(self, batch: list[ScheduledRequest]) -> StepPlan: ...

    def sample_row(
        self, s: ScheduledRequest, outputs: list[int], generator: torch.Generator | None
    ) -> SampleRequest: ...


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The target's engine config with the draft model in its place: the same KV blocks,
    dtype and device; unsharded, eager, no adapters."""
    spec = config.speculative
    assert spec is not None and spec.model is not None
    return dataclasses.replace(
        config,
        model_dir=spec.model,
        model=ModelConfig.from_model_dir(spec.model),
        quantization=check_quantization(spec.quantization),
        tensor_parallel_size=1,
        enforce_eager=True,
        lora=None,
        speculative=None,
    )


def token_range(s: ScheduledRequest, lo: int, hi: int) -> list[int]:
    """The request's known tokens (prompt, then output) at positions [lo, hi)."""
    prompt, out = s.prompt_token_ids, s.output_token_ids
    n = len(prompt)
    return [*prompt[lo:hi], *out[max(lo - n, 0) : max(hi - n, 0)]]


class DraftRunner:
    """The draft model (on rank 0: it is not split over tensor-parallel ranks) and how far
    each request's draft KV is right."""

    def __init__(self, config: EngineConfig, runner: TargetRunner) -> None:
        self.executor = ShardExecutor(draft_engine_config(config))
        self.runner = runner  # plans steps (same block size) and builds sampling rows
        self.computed: dict[str, int] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.computed.pop(request_id, None)

    def verified(self, batch: Sequence[ScheduledRequest], out: RunnerOutput) -> None:
        """The drafts of `batch` are verified (`out`): each request's draft KV is right up
        to its accepted drafts (the last draft and the emitted token were never fed)."""
        for s in batch:
            rid = s.request_id
            if s.spec_token_ids and rid in self.computed:
                emitted = 1 + len(out.spec_token_ids.get(rid, ()))
                self.computed[rid] = min(self.computed[rid], s.start_pos + emitted)

    @torch.inference_mode()
    def propose(
        self, batch: list[ScheduledRequest], block_copies: list[tuple[int, int]]
    ) -> dict[str, Draft]:
        """Fill in the draft tokens of `batch`'s speculating requests (in place: their
        `spec_token_ids` and `token_ids` after the first); the draft's distributions of
        those that sample (not greedy), by request id."""
        if block_copies:  # beams' copy-on-write: the draft's KV goes along
            copy_blocks(self.executor.kv_caches, block_copies)
        drafting = [s for s in batch if s.spec_token_ids]
        logits = self._catch_up(batch)
        if not drafting:
            return {}
        device = self.executor.device
        gens = {
            s.request_id: step_generator(s.seed, len(s.output_token_ids), device)
            for s in drafting
            if not s.params.greedy
        }
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in gens}
        tokens: dict[str, list[int]] = {s.request_id: [] for s in drafting}
        active = drafting
        for i in range(max(len(s.spec_token_ids) for s in drafting)):
            if i > 0:  # feed d_i at p + i; its logits give d_{i+1}
                active = [s for s in active if len(s.spec_token_ids) > i]
                logits = self._decode(active, tokens, i)
            rows = [self._row(s, tokens[s.request_id]) for s in active]
            meta = SamplingMetadata.build(rows, logits.shape[1], device)
            q = sampling_probs(logits, rows, meta)
            u = torch.cat([uniforms(1, gens.get(s.request_id), device) for s in active])
            for j, (s, token) in enumerate(zip(active, draw(q, u), strict=True)):
                tokens[s.request_id].append(token)
                if s.request_id in probs:
                    probs[s.request_id].append(q[j])
        for s in drafting:
            s.spec_token_ids[:] = tokens[s.request_id]
            s.token_ids[1:] = tokens[s.request_id]
            # d_1..d_{k-1} were fed: right as far as they are accepted (`verified`)
            self.computed[s.request_id] = s.start_pos + len(s.spec_token_ids)
        return {rid: Draft(torch.stack(probs[rid]), gens[rid]) for rid in gens}

    def _catch_up(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """The first pass: drafting requests from their first position without right draft
        KV through their last token (logits there, in `batch`'s order), and prefill chunks."""
        work: list[ScheduledRequest] = []
        for s in batch:
            rid = s.request_id
            # first seen: its prefix-cache hits hold the draft's KV; past its own start:
            # recomputed since (preempted, rolled back)
            done = self.computed[rid] = min(self.computed.get(rid, s.start_pos), s.start_pos)
            if s.spec_token_ids:
                end = s.start_pos + 1
            elif s.num_tokens > 1:
                end = s.start_pos + s.num_tokens
            else:
                continue  # a plain decode: caught up when the request drafts again
            self.computed[rid] = end
            work.append(
                dataclasses.replace(
                    s,
                    token_ids=token_range(s, done, end),
                    start_pos=done,
                    sample=bool(s.spec_token_ids),
                    spec_token_ids=[],
                )
            )
        if not work:
            return torch.empty(0)
        # decodes first, as the attention backends expect; logits back in `batch`'s order
        order = sorted(range(len(work)), key=lambda i: work[i].num_tokens > 1)
        logits = self._forward([work[i] for i in order])
        sampled = [i for i in order if work[i].sample]
        return logits[torch.tensor(sampled).argsort()]

    def _decode(
        self, active: list[ScheduledRequest], tokens: dict[str, list[int]], i: int
    ) -> torch.Tensor:
        """Pass i + 1: each active request's d_i at position p + i."""
        steps = [
            dataclasses.replace(
                s,
                token_ids=[tokens[s.request_id][i - 1]],
                start_pos=s.start_pos + i,
                sample=True,
                spec_token_ids=[],
            )
            for s in active
        ]
        return self._forward(steps)

    def _forward(self, steps: list[ScheduledRequest]) -> torch.Tensor:
        return self.executor.forward(self.runner.plan(steps))

    def _row(self, s: ScheduledRequest, drafted: list[int]) -> SampleRequest:
        return self.runner.sample_row(s, [*s.output_token_ids, *drafted], None)
