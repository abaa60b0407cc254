"""The pooling engine: a `*ForCausalLM` used as an embedder (vLLM's `runner="pooling"`).

An embedding is one prefill and no decode, so this engine has no scheduler: the prompts of a
call are packed into forward passes of at most `token_budget` tokens (and `max_num_seqs`
sequences), each sequence written to fresh KV blocks of a small pool of its own (nothing is
kept between passes), and each pass's hidden states are pooled at once. Why not the generation
scheduler: docs/embeddings.md (measured there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pagedllm.config import ConfigError, EngineConfig
from pagedllm.model.decoder import ForwardContext
from pagedllm.pooling.params import PoolerConfig, PoolingParams, resolve_pooler
from pagedllm.pooling.pooler import finish, pool
from pagedllm.text import Tokenizer
from pagedllm.worker.executor import ShardExecutor, StepPlan, use_device


@dataclasses.dataclass(frozen=True)
class EmbedRequest:
    """A prompt ready to run: its token ids (truncated), its vector size, whether normalised."""

    token_ids: list[int]
    size: int
    normalize: bool


class PoolingEngine:
    def __init__(self, config: EngineConfig, pooler_config: PoolerConfig | None = None) -> None:
        if config.tensor_parallel_size != 1:
            raise ConfigError("the pooling runner runs on one rank (tensor_parallel_size 1)")
        if config.model.hybrid is not None or config.lora is not None:
            raise ConfigError("the pooling runner takes neither hybrid (Qwen3.5) models nor LoRA")
        sched = config.scheduler
        # NOTE: a prompt is never split over passes (MEAN needs all its tokens at once)
        self.token_budget = max(sched.max_num_batched_tokens, sched.max_model_len)
        self.max_num_seqs = sched.max_num_seqs
        bs = config.cache.block_size
        blocks = -(-self.token_budget // bs) + self.max_num_seqs  # a partial block per sequence
        cache = dataclasses.replace(config.cache, num_kv_blocks=blocks, enable_prefix_caching=False)
        self.config = dataclasses.replace(config, cache=cache, enforce_eager=True)
        self.pooler = resolve_pooler(config.model_dir, pooler_config)
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        self.executor = ShardExecutor(self.config)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def prepare(self, prompt: str | list[int], params: PoolingParams) -> EmbedRequest:
        """Tokenize and check one prompt; ValueError (the message a client sees) when it
        cannot run: empty, ids out of the vocabulary, longer than max_model_len without
        `truncate_prompt_tokens`, or `dimensions` the model does not allow."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.config.model.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if keep > self.max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens {keep} exceeds max_model_len {self.max_model_len}"
                )
            ids = ids[-keep:]
        if not ids:
            raise ValueError("the input is empty: nothing to embed")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the input has {len(ids)} tokens, more than max_model_len "
                f"{self.max_model_len} (truncate_prompt_tokens cuts it)"
            )
        size = self.pooler.output_size(params)
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return EmbedRequest(ids, size, normalize)

    def embed(self, requests: Sequence[EmbedRequest]) -> list[torch.Tensor]:
        """One fp32 vector per request, in order (on the CPU)."""
        out: list[torch.Tensor] = []
        for batch in self._batches(requests):
            pooled = self._pool(batch)
            out += [
                finish(v, r.size, r.normalize).cpu() for v, r in zip(pooled, batch, strict=True)
            ]
        return out

    def _batches(self, requests: Sequence[EmbedRequest]) -> list[list[EmbedRequest]]:
        batches: list[list[EmbedRequest]] = [[]]
        tokens = 0
        for r in requests:
            n = len(r.token_ids)
            if batches[-1] and (
                tokens + n > self.token_budget or len(batches[-1]) == self.max_num_seqs
            ):
                batches.append([])
                tokens = 0
            batches[-1].append(r)
            tokens += n
        return [b for b in batches if b]

    @torch.inference_mode()
    def _pool(self, batch: list[EmbedRequest]) -> torch.Tensor:
        """One forward pass over `batch` (prefills only): its pooled (B, H) vectors."""
        ex = self.executor
        use_device(ex.device)
        # the attention backends take single-token sequences (decodes) first
        order = sorted(range(len(batch)), key=lambda i: len(batch[i].token_ids) > 1)
        plan = _prefill_plan([batch[i].token_ids for i in order], ex.block_size)
        step = ex.inputs(plan)
        metadata = ex.backend.build_metadata(step)
        ctx = ForwardContext(ex.rotations(step.positions), ex.kv_caches, ex.backend, metadata)
        hidden = ex.model.hidden_states(step.input_ids, ctx)
        pooled = pool(hidden, [len(batch[i].token_ids) for i in order], self.pooler.pooling_type)
        result = torch.empty_like(pooled)
        result[torch.tensor(order, device=pooled.device)] = pooled
        return result


def _prefill_plan(prompts: list[list[int]], block_size: int) -> StepPlan:
    """Whole prompts from position 0, each on its own consecutive blocks from block 0."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts, tables = [0], []
    next_block = 0
    for p in prompts:
        n = len(p)
        first = next_block
        next_block += -(-n // block_size)
        ids += p
        positions += range(n)
        slots += range(first * block_size, first * block_size + n)
        starts.append(len(ids))
        tables.append(list(range(first, next_block)))
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    num_decodes = sum(1 for p in prompts if len(p) == 1)
    lens = [len(p) for p in prompts]
    return StepPlan(ids, positions, slots, starts, lens, tables, num_decodes, [])
