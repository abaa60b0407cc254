"""Runs one scheduled step: flattens the batch, runs the model over the paged KV cache and
samples the next token of every request whose chunk reached its end."""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.layers.attention import StepInputs, create_attention_backend
from pagedllm.model import load_model
from pagedllm.model.llama import ForwardContext
from pagedllm.model.rope import rope_cos_sin, rotary_table


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        mcfg = config.model
        self.model = load_model(config.model_dir, mcfg, config.dtype, config.device)
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
        batch = order_batch(sched.scheduled)
        step = self.prepare_inputs(batch)
        rotary = self.rotary[step.positions].unsqueeze(1)
        metadata = self.backend.build_metadata(step)
        ctx = ForwardContext(rotary, self.kv_caches, self.backend, metadata)
        logits = self.model(step.input_ids, ctx, step.logits_indices)
        sampled = logits.argmax(dim=-1).tolist()
        ids = [s.request_id for s in batch if s.sample]
        return RunnerOutput(dict(zip(ids, sampled, strict=True)))


def order_batch(batch: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes (one new token) first, prefill chunks after, as the attention backends expect."""
    return sorted(batch, key=lambda s: s.num_tokens > 1)
