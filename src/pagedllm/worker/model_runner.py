"""Runs one scheduled step: flattens the batch, runs the model over the paged KV cache and
samples the next token of every request whose chunk reached its end."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.layers.attention import StepInputs, create_attention_backend
from pagedllm.layers.bitmask import apply_token_bitmask_, ban_
from pagedllm.layers.sampler import (
    Sampler,
    SampleRequest,
    SamplingMetadata,
    bad_word_bans,
    prompt_logprobs,
)
from pagedllm.model import load_model
from pagedllm.model.llama import ForwardContext
from pagedllm.model.rope import rope_cos_sin, rotary_table
from pagedllm.worker import cuda_graphs

if TYPE_CHECKING:  # llguidance is imported only once a request is constrained
    from pagedllm.structured.matchers import GrammarMatchers, Masks


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        use_device(self.device)
        mcfg = config.model
        self.model = load_model(
            config.model_dir, mcfg, config.dtype, config.device, config.quantization
        )
        self.backend = create_attention_backend(config.attention_backend, config.device)
        self.block_size = config.cache.block_size
        num_kv_blocks = config.cache.num_kv_blocks
        assert num_kv_blocks is not None
        shape = self.backend.kv_cache_shape(
            num_kv_blocks, self.block_size, mcfg.num_kv_heads, mcfg.head_dim
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=config.dtype, device=self.device)
            for _ in range(mcfg.num_layers)
        ]
        cos, sin = rope_cos_sin(
            mcfg.rope, mcfg.head_dim, mcfg.max_position_embeddings, config.scheduler.max_model_len
        )
        self.rotary = rotary_table(cos, sin).to(self.device)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        # structured outputs: set by the engine with the first constrained request
        self.grammars: GrammarMatchers | None = None
        # GPU only: decode steps through CUDA graphs (None on the CPU or with enforce_eager)
        self.graphs = cuda_graphs.create_graph_runner(self)
        if self.graphs is not None:
            self.graphs.capture()

    def prepare_inputs(self, batch: list[ScheduledRequest]) -> StepInputs:
        """`batch` must hold the decodes first (see `order_batch`)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens = []
        logits_indices = []
        for s in batch:
            end = s.start_pos + s.num_tokens
            input_ids += s.token_ids
            pos = range(s.start_pos, end)
            positions += pos
            table = s.block_ids
            slots += [table[p // bs] * bs + p % bs for p in pos]
            query_start_loc.append(len(input_ids))
            context_lens.append(end)
            if s.sample:
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(s.block_ids) for s in batch)
        tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in batch]
        num_decodes = next((i for i, s in enumerate(batch) if s.num_tokens > 1), len(batch))

        def t(x: list[int] | list[list[int]]) -> torch.Tensor:
            if self.device.type == "cuda":  # pinned host memory, non-blocking copy
                pinned = cuda_graphs.host_tensor(x, torch.int64, pin=True)
                return pinned.to(self.device, non_blocking=True)
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        return StepInputs(
            input_ids=t(input_ids),
            positions=t(positions),
            slot_mapping=t(slots),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=t(tables),
            num_decodes=num_decodes,
            logits_indices=t(logits_indices),
            block_size=bs,
            sliding_window=self.config.model.sliding_window,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        use_device(self.device)  # the engine's step thread starts on cuda:0
        for request_id in sched.finished_ids:
            self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(sched.finished_ids)
        batch = order_batch(sched.scheduled)
        sampled = [s for s in batch if s.sample]
        # the grammars' next-token masks are filled on their own thread during the forward pass
        fill = self._fill_masks(sampled)
        try:
            logits, spans = self._forward(batch)
        finally:  # the mask thread is done with this step's requests before the step ends
            masks = None if fill is None else fill.result()
        out = RunnerOutput()
        if sampled:
            self._sample(logits[: len(sampled)], sampled, out, masks)
        offset = len(sampled)
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
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, list[_PromptLogprobSpan]]:
        """The logits of the sampled rows, then of the prompt positions scored for prompt
        log-probs (the spans)."""
        step = self.prepare_inputs(batch)
        spans = _prompt_logprob_spans(batch, step.query_start_loc)
        indices = step.logits_indices
        if spans:
            extra = [
                i for span in spans for i in range(span.flat_start, span.flat_start + span.count)
            ]
            indices = torch.cat([indices, torch.tensor(extra, device=self.device)])
        if self.graphs is not None and not spans and self.graphs.can_run(step):
            return self.graphs.run(step), spans  # a GPU decode step: one CUDA graph replay
        rotary = self.rotary[step.positions].unsqueeze(1)
        metadata = self.backend.build_metadata(step)
        ctx = ForwardContext(rotary, self.kv_caches, self.backend, metadata)
        return self.model(step.input_ids, ctx, indices), spans

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
    ) -> None:
        rows = [
            SampleRequest(
                s.params,
                s.prompt_token_ids,
                s.output_token_ids,
                self._generator(s),
                self._stop_ids(s) if _before_min_tokens(s) else (),
            )
            for s in batch
        ]
        if masks is not None:  # before the sampler: log-probs are of the masked logits
            self._constrain(logits, rows, masks)
            out.failed.update(masks.failed)
        meta = SamplingMetadata.build(rows, logits.shape[1], self.device)
        result = self.sampler(logits, rows, meta)
        for s, token, lp in zip(batch, result.token_ids, result.logprobs, strict=True):
            out.sampled_token_ids[s.request_id] = token
            if lp is not None:
                out.logprobs[s.request_id] = lp

    def _constrain(self, logits: torch.Tensor, rows: list[SampleRequest], masks: Masks) -> None:
        """The grammars' masks on their rows. For those rows min_tokens' and bad words' bans
        go through the mask, which they must not empty: the grammar wins (a complete grammar
        allows only EOS). EOS ends a constrained request whatever `ignore_eos` says, so
        min_tokens holds it back there."""
        constrained = [i for i, r in enumerate(rows) if r.params.structured_outputs]
        eos = self.config.model.eos_token_ids
        for i in constrained:
            r = rows[i]
            early = len(r.output_token_ids) < r.params.min_tokens
            bans = [*eos, *r.params.stop_token_ids] if early else []
            bans += [t for _, t in bad_word_bans([r])]
            if bans:
                ban_(masks.bitmask, i, bans)
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


def _before_min_tokens(s: ScheduledRequest) -> bool:
    return len(s.output_token_ids) < s.params.min_tokens


@dataclass
class _PromptLogprobSpan:
    request: ScheduledRequest
    flat_start: int  # first token of the span in the flat batch
    count: int  # tokens whose next token is a prompt token
    first_pos: int  # position of the first prompt token scored
    num_top: int


def _prompt_logprob_spans(
    batch: list[ScheduledRequest], query_start_loc: list[int]
) -> list[_PromptLogprobSpan]:
    spans = []
    for r, s in enumerate(batch):
        num_top = s.params.prompt_logprobs
        if num_top is None:
            continue
        # logits at position p score prompt token p + 1
        count = min(s.start_pos + s.num_tokens, len(s.prompt_token_ids) - 1) - s.start_pos
        if count > 0:
            spans.append(_PromptLogprobSpan(s, query_start_loc[r], count, s.start_pos + 1, num_top))
    return spans


def order_batch(batch: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes (one new token) first, prefill chunks after, as the attention backends expect."""
    return sorted(batch, key=lambda s: s.num_tokens > 1)


def use_device(device: torch.device) -> None:
    """Make a CUDA device this thread's current one: Triton launches and graph captures go to
    the current device, whatever their tensors' device."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
