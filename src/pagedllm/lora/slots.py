"""Where adapters live while they serve: a host cache of read adapters (LRU, `max_cpu_loras`)
and a device pool of `max_loras` slots, each layer's modules holding every slot's A and B
stacked; rank 0's `SlotTable` picks each step's slots (least recently used evicted), and
every rank loads what the step's plan names.

Per layer and module the pool holds A (slots, parts * R, in) and B (slots, out, parts * R), R =
max_lora_rank, `parts` the projections fused in the module (q/k/v: 3, gate/up: 2): part j's
A rows at [j R, j R + r), its B block at rows of part j, columns [j R, j R + r); the rest
zero. One matmul pair then serves a fused module whichever of its parts an adapter adapts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pagedllm.lora.adapter import PROJECTIONS, LoraAdapter, LoRAError, load_adapter
from pagedllm.lora.ops import MODULES, LoraStep
from pagedllm.lora.pool import pool_shapes
from pagedllm.lora.request import LoRAConfig, LoRARequest
from pagedllm.model_config import ModelConfig

if TYPE_CHECKING:
    from pagedllm.core.scheduler import ScheduledRequest
    from pagedllm.distributed.shard import ShardPlan

# our parameter of each module (ShardPlan.slice_of names)
_PARAMS = {
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
}


class HostCache:
    """Adapters read and checked, by `lora_int_id`, the least recently used dropped past
    `capacity` (read again from their folder when next needed); adapters given in memory
    (`pin`: TensorRT-LLM's lora_weights, serving/lora_tasks.py) stay until `unpin`."""

    def __init__(self, cfg: ModelConfig, lora: LoRAConfig) -> None:
        self.cfg, self.lora = cfg, lora
        self._adapters: OrderedDict[int, LoraAdapter] = OrderedDict()
        self._pinned: dict[int, LoraAdapter] = {}

    def pin(self, adapter: LoraAdapter) -> None:
        self._pinned[adapter.request.lora_int_id] = adapter

    def unpin(self, lora_int_id: int) -> None:
        self._pinned.pop(lora_int_id, None)

    def get(self, request: LoRARequest) -> LoraAdapter:
        if (pinned := self._pinned.get(request.lora_int_id)) is not None:
            return pinned
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.cfg, self.lora.max_lora_rank)
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.lora.cpu_capacity:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(request.lora_int_id)
        return adapter

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters or lora_int_id in self._pinned


class SlotTable:
    """Rank 0: which adapter holds which slot; each step's adapters get slots, evicting the
    least recently used one no request of the step needs."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.num_loads = 0

    def assign(self, requests: Iterable[LoRARequest]) -> list[tuple[int, LoRARequest]]:
        """Give every adapter of a step a slot; returns the (slot, adapter) loads to do.
        The scheduler admits at most `num_slots` adapters among running requests."""
        needed = {r.lora_int_id: r for r in requests}
        assert len(needed) <= self.num_slots, "more adapters in a step than slots"
        loads = []
        for lora_id, request in needed.items():
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            used = set(self._slots.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self._slots if i not in needed)
                slot = self._slots.pop(victim)
            self._slots[lora_id] = slot
            loads.append((slot, request))
        self.num_loads += len(loads)
        return loads

    def plan(
        self, batch: list[ScheduledRequest]
    ) -> tuple[list[tuple[int, LoRARequest]], list[int]]:
        """A step's loads and each of its tokens' slot (-1: the base model), `batch` in the
        order of the flat batch."""
        loads = self.assign(s.lora_request for s in batch if s.lora_request is not None)
        slots: list[int] = []
        for s in batch:
            slot = -1 if s.lora_request is None else self._slots[s.lora_request.lora_int_id]
            slots += [slot] * s.num_tokens
        return loads, slots

    def forget(self, lora_int_id: int) -> None:
        """An adapter unloaded: its slot is free (its weights are overwritten when reused)."""
        self._slots.pop(lora_int_id, None)


class LoraSlots:
    """One rank's device pool (see the module's docstring) and its host cache."""

    def __init__(
        self,
        lora: LoRAConfig,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        plan: ShardPlan | None = None,
    ) -> None:
        self.config, self.cfg, self.plan = lora, cfg, plan
        self.host = HostCache(cfg, lora)
        local = cfg if plan is None else plan.local_config(cfg)
        q, kv = local.num_heads * local.head_dim, local.num_kv_heads * local.head_dim
        i = local.intermediate_size
        self._part_rows = {"qkv": [0, q, q + kv], "o": [0], "gate_up": [0, i], "down": [0]}
        layers = cfg.num_layers
        # module -> every layer's A and B (lora/pool.py), allocated once: a slot is written
        # by one copy per tensor (a swap is 8 copies), and captured CUDA graphs read them
        self.pool = {
            m: (
                torch.zeros(a, dtype=dtype, device=device),
                torch.zeros(b, dtype=dtype, device=device),
            )
            for m, (a, b) in pool_shapes(local, lora).items()
        }
        moe = cfg.layer_moe or (False,) * layers  # an MoE layer's MLP takes no adapter
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {
                m: (a[layer], b[layer])
                for m, (a, b) in self.pool.items()
                if not (m in ("gate_up", "down") and moe[layer])
            }
            for layer in range(layers)
        ]
        # module -> which slots' adapters adapt it (a module no slot of a step adapts is skipped)
        self.adapts = {m: [False] * lora.max_loras for m in MODULES}
        self.device = device

    def load(self, slot: int, request: LoRARequest) -> None:
        """Write `request`'s adapter into `slot` (this rank's shard of it): staged whole in
        host memory, then one copy per pool tensor."""
        adapter = self.host.get(request)
        r = self.config.max_lora_rank
        staged = {
            m: (a.new_zeros(a[:, 0].shape, device="cpu"), b.new_zeros(b[:, 0].shape, device="cpu"))
            for m, (a, b) in self.pool.items()
        }
        for (layer, proj), (a_full, b_full) in adapter.weights.items():
            module, part = PROJECTIONS[proj]
            a_part, b_part = self._shard(a_full, b_full, layer, module, part)
            a, b = staged[module]
            rows, rank = self._part_rows[module][part], a_part.shape[0]
            a[layer, part * r : part * r + rank].copy_(a_part)
            b[layer, rows : rows + b_part.shape[0], part * r : part * r + rank].copy_(b_part)
        for m, (a, b) in self.pool.items():
            a[:, slot].copy_(staged[m][0], non_blocking=True)
            b[:, slot].copy_(staged[m][1], non_blocking=True)
            self.adapts[m][slot] = m in adapter.modules

    def _shard(
        self, a: torch.Tensor, b: torch.Tensor, layer: int, module: str, part: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B: B's rows as its column-parallel base layer's, A's columns as
        its row-parallel one's (the partial deltas are summed by the layer's all-reduce)."""
        if self.plan is None:
            return a, b
        name = f"layers.{layer}.{_PARAMS[module]}.weight"
        cut = self.plan.slice_of(
            name,
            part if module in ("qkv", "gate_up") else None,
            self.cfg.head_dim,
            self.cfg.qk_norm,
        )
        if cut is None:
            return a, b
        dim, start, length = cut
        if dim == 0:
            return a, b.narrow(0, start, length)
        return a.narrow(1, start, length), b

    def step(self, loads: list[tuple[int, LoRARequest]], token_slots: list[int]) -> LoraStep | None:
        """Do a step's loads; the step's batched LoRA computation (None: no token uses an
        adapter)."""
        self.load_all(loads)
        if all(s < 0 for s in token_slots):
            return None
        parts = self._part_rows
        return LoraStep.create(self.weights, token_slots, self.adapts, self.device, parts)

    def load_all(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """A step's loads, into the pool's tensors in place (before a graph's replay)."""
        for slot, request in loads:
            self.load(slot, request)

    def graph_step(self, token_slots: torch.Tensor) -> LoraStep:
        """A CUDA graph's LoRA computation: each row's slot read from `token_slots` (a
        buffer; -1: nothing read or written), every module of every slot, in Triton."""
        return LoraStep(self.weights, [], frozenset(), token_slots, None, self._part_rows, True)


def check_request(slots: LoraSlots | None, request: LoRARequest | None) -> None:
    """Read and check a request's adapter (kept in the host cache); ValueError (LoRAError)
    naming what is wrong, or that LoRA is off."""
    if request is None:
        return
    if slots is None:
        raise LoRAError(
            f"adapter {request.lora_name!r} requested, but LoRA is not enabled on this engine "
            "(enable_lora=True)"
        )
    slots.host.get(request)
