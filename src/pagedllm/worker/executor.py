"""One rank's part of the model and its forward pass over a step: the model (or its
tensor-parallel shard), its KV cache, the attention backend and the CUDA graphs.

Rank 0's executor is the `ModelRunner` (which also plans steps and samples); the other ranks
of a tensor-parallel engine run a plain `ShardExecutor` in worker processes
(`worker.tp_worker`) over the same `StepPlan`, broadcast by rank 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm import kv_cache_dtype
from pagedllm.config import EngineConfig
from pagedllm.distributed.comm import TPGroup
from pagedllm.distributed.shard import ShardPlan
from pagedllm.layers.attention import StepInputs, create_attention_backend
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import LoraSlots
from pagedllm.model import arena, kv_scales, load_model
from pagedllm.model.decoder import ForwardContext
from pagedllm.model.gdn_block import build_step, new_states, spread_kv_caches
from pagedllm.model.gguf import blocked_modules
from pagedllm.model.rope import rotary_table
from pagedllm.worker import cuda_graphs

logger = logging.getLogger(__name__)


def engine_plan(config: EngineConfig, rank: int, world: int) -> ShardPlan:
    """Rank `rank`'s plan for the engine's model; a GGUF file's quantized blocks are cut whole
    (model/gguf.py `blocked_modules`), so its row-parallel weights split only between them."""
    blocked: frozenset[str] = frozenset()
    if config.quantization == "gguf" and world > 1:
        blocked = blocked_modules(Path(config.model_dir))
    return ShardPlan.create(config.model, rank, world, blocked)


@dataclass
class StepPlan:
    """A step's inputs as plain lists (what rank 0 broadcasts): the flattened batch, decodes
    first (`num_decodes` of them), and the rows whose logits are wanted."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    logits_indices: list[int]
    # logits of prompt positions are wanted too (prompt log-probs): no CUDA graph
    eager: bool = False
    # (source, destination) KV blocks to copy first, in every layer (beams' copy-on-write)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # a hybrid model: each request's linear-attention state slot, and whether it continues
    # from it (else it starts from zeros: its first token is position 0)
    state_slots: list[int] = field(default_factory=list)
    state_continues: list[bool] = field(default_factory=list)
    # LoRA: the (slot, adapter) loads to do first, and each token's slot (-1: the base model)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU for every rank, or the rank-th GPU from the engine's."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


class ShardExecutor:
    def __init__(
        self, config: EngineConfig, rank: int = 0, world: int = 1, tp: TPGroup | None = None
    ) -> None:
        self.config = config
        self.device = rank_device(config.device, rank)
        use_device(self.device)
        mcfg = config.model
        plan = engine_plan(config, rank, world) if world > 1 else None
        self.model = load_model(
            config.model_dir,
            mcfg,
            config.dtype,
            str(self.device),
            config.quantization,
            plan,
            tp,
        )
        backend = config.attention_backend
        if mcfg.mla is not None:  # latent attention (model/mla.py): Triton write and decodes
            triton = backend == "triton" or (backend == "auto" and self.device.type == "cuda")
            backend = "triton-mla" if triton else "torch"
        if self.device.type == "cpu" and config.cache.cache_dtype in kv_cache_dtype.FP8:
            backend = "torch"  # fp8 on the CPU: the reference path alone (no C++ kernel)
        self.backend = create_attention_backend(backend, str(self.device))
        # fp8 scales to estimate from the first forward (then the graphs are captured)
        self.scale_estimator = kv_scales.estimator(config, self.model, self.backend)
        self._capture_pending = False
        self.block_size = config.cache.block_size
        num_kv_blocks = config.cache.num_kv_blocks
        assert num_kv_blocks is not None
        local = self.model.config  # the shard's KV heads
        kind = config.cache.cache_dtype
        # an int8 cache's rows carry their scale after the head_dim values
        row = local.head_dim + kv_cache_dtype.row_extra(kind)
        shape = self.backend.kv_cache_shape(num_kv_blocks, self.block_size, local.num_kv_heads, row)
        if mcfg.mla is not None:  # per token: the latent and the rotated key, every rank
            shape = (num_kv_blocks, self.block_size, mcfg.mla.cache_dim)
        hybrid = local.hybrid  # its linear layers: a state pool each instead of a KV cache
        num_kv = mcfg.num_kv_layers
        cache_dtype = kv_cache_dtype.storage_dtype(kind, config.dtype)
        if self.device.type == "cpu":  # on huge pages, as the weights
            kv_caches = arena.zeros(shape, cache_dtype, num_kv)
        else:
            kv_caches = [
                torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in range(num_kv)
            ]
        self.kv_caches = spread_kv_caches(kv_caches, hybrid)
        slots = cuda_graphs.state_pool_slots(config, self.device)  # (+ graphs' scratch slot)
        self.states = [] if hybrid is None or not slots else new_states(
            hybrid, slots, config.dtype, self.device)  # fmt: skip
        if rank == 0:
            logger.info("%s", config.kv_capacity_line())
        # one table per rope of the model (ModelConfig.ropes), (max_model_len, head_dim / 2)
        self.rotary = [
            rotary_table(
                rope, mcfg.head_dim, mcfg.max_position_embeddings, config.scheduler.max_model_len
            ).to(self.device)
            for rope in mcfg.ropes
        ]
        # the device pool of LoRA adapters (lora/slots.py), this rank's shard of each
        self.lora = None
        if config.lora is not None:
            self.lora = LoraSlots(config.lora, mcfg, self.device, config.dtype, plan)
        # GPU only: decode steps through CUDA graphs (None on the CPU or with enforce_eager),
        # captured by `capture_graphs` (with tensor parallelism: on every rank, once all hold
        # their shards, since the graphs hold the collectives); with LoRA, they read the pool
        self.graphs = cuda_graphs.create_graph_runner(self)

    def capture_graphs(self) -> None:
        if self.graphs is not None and self.scale_estimator is not None:
            self._capture_pending = True  # after the scales: the graphs hold them
        elif self.graphs is not None:
            self.graphs.capture()

    def inputs(self, plan: StepPlan) -> StepInputs:
        def t(x: list[int] | list[list[int]]) -> torch.Tensor:
            if self.device.type == "cuda":  # pinned host memory, non-blocking copy
                pinned = cuda_graphs.host_tensor(x, torch.int64, pin=True)
                return pinned.to(self.device, non_blocking=True)
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        return StepInputs(
            input_ids=t(plan.input_ids),
            positions=t(plan.positions),
            slot_mapping=t(plan.slot_mapping),
            query_start_loc=plan.query_start_loc,
            context_lens=plan.context_lens,
            block_tables=t(plan.block_tables),
            num_decodes=plan.num_decodes,
            logits_indices=t(plan.logits_indices),
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The logits of `plan.logits_indices` (on rank 0; other ranks' are not the whole
        vocabulary)."""
        use_device(self.device)  # the engine's step thread starts on cuda:0
        if plan.block_copies:
            copy_blocks(self.kv_caches, plan.block_copies)
        step = self.inputs(plan)
        if self.graphs is not None and not plan.eager and self.graphs.can_run(step):
            if self.lora is not None:  # adapters swapped in before the replay
                self.lora.load_all(plan.lora_loads)
            states = (plan.state_slots, plan.state_continues)  # (a hybrid model's)
            # a GPU decode step: one CUDA graph replay (each row's adapter slot in a buffer)
            return self.graphs.run(step, states, plan.lora_slots)
        lora = None if self.lora is None else self.lora.step(plan.lora_loads, plan.lora_slots)
        estimator = self.scale_estimator
        backend = estimator or self.backend
        metadata = backend.build_metadata(step)
        rotary = self.rotations(step.positions)
        ctx = ForwardContext(rotary, self.kv_caches, backend, metadata, lora)  # type: ignore[arg-type]
        if self.states:  # a hybrid model: the requests' linear-attention state slots
            gdn = build_step(plan.query_start_loc, plan.state_slots, plan.state_continues,
                             self.states, self.device)  # fmt: skip
            ctx = ctx._replace(gdn=gdn)
        logits = self.model(step.input_ids, ctx, step.logits_indices)
        if estimator is not None:
            kv_scales.install(self.model, estimator.scales)
            self.scale_estimator = None
            if self._capture_pending:
                self.capture_graphs()
        return logits

    def rotations(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each token's rotation by each rope of the model, (N, 1, head_dim / 2) complex."""
        return tuple(table[positions].unsqueeze(1) for table in self.rotary)


def copy_blocks(kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks in every layer (each layer's cache is indexed by block first)."""
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    for cache in kv_caches:
        if cache.element_size() == 1:  # int8 or fp8: as bytes (no fp8 kernels everywhere)
            cache = cache.view(torch.uint8)
        cache.index_copy_(0, dst, cache.index_select(0, src))


def use_device(device: torch.device) -> None:
    """Make a CUDA device this thread's current one: Triton launches and graph captures go to
    the current device, whatever their tensors' device."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
