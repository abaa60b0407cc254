"""CUDA graphs for decode steps: one graph per padded batch size, replayed over static input
buffers.

A decode-only step of `n` requests is padded to the smallest captured size `s >= n`: the
first `n` rows of the static buffers get the step's inputs, rows `n..s` are padding (token 0,
position 0, slot -1 = no cache write, context 0 = attention output 0), the graph of size `s` is
replayed and the first `n` rows of its logits are returned. Graphs are captured from the
largest size down, all in one memory pool: the largest allocates it, the others reuse it.

Everything but `CudaGraphBackend` (the only code that touches `torch.cuda`) runs on any
device, so the padding, selection and capture order are unit-tested on the CPU with a fake
graph backend (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pagedllm.layers.attention.base import StepInputs

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

MAX_CAPTURE_SIZE = 512
StateRows = tuple[Sequence[int], Sequence[bool]]  # a hybrid step's state slots, continue flags


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, as vLLM's: 1, 2, 4, then every multiple of 8, up to the first
    one >= `max_num_seqs` (at most `MAX_CAPTURE_SIZE`; larger batches run eagerly)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = []
    for size in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(size)
        if size >= top:
            break
    return sizes


def max_decode_rows(config: EngineConfig) -> int:
    """The most rows a decode step has: one per running request, and with speculative decoding
    `num_speculative_tokens` more per drafting one (its draft verified as decode rows), drafts
    being made only while at most `max_batch_size` requests run."""
    seqs, spec = config.scheduler.max_num_seqs, config.speculative
    if spec is None:
        return seqs
    return max(seqs, min(seqs, spec.max_batch_size) * (1 + spec.num_speculative_tokens))


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest of the (ascending) `sizes` that holds `n` rows; None if none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def host_tensor(values: list[int] | list[list[int]], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor; pinned (page-locked) when it feeds a non-blocking copy to a GPU."""
    return torch.tensor(values, dtype=dtype, pin_memory=pin)


@dataclass
class DecodeBuffers:
    """The static inputs of captured decode steps (`max_size` rows). A graph reads the first
    `size` rows through `view(size)`; its addresses never change."""

    input_ids: torch.Tensor  # (S,) int64
    positions: torch.Tensor  # (S,) int64
    slot_mapping: torch.Tensor  # (S,) int64, -1 = padding
    context_lens: torch.Tensor  # (S,) int32, 0 = padding
    block_tables: torch.Tensor  # (S, max_blocks_per_seq) int32
    logits_indices: torch.Tensor  # (S,) int64 = arange(S): every decode is sampled
    # a hybrid model's linear-attention state (model/gdn_block.py): each row's slot, whether
    # it continues from it (1) or starts from zeros (0), the rows' token bounds (arange(S + 1));
    # padding rows use `pad_slot`, a scratch slot no request holds
    state_slots: torch.Tensor  # (S,) int32
    state_init: torch.Tensor  # (S,) int32
    query_start_loc: torch.Tensor  # (S + 1,) int32
    # LoRA: each row's adapter slot in the pool (lora/slots.py `graph_step`), -1: none (padding)
    lora_slots: torch.Tensor
    pad_slot: int = 0

    @staticmethod
    def allocate(
        max_size: int, max_blocks: int, device: torch.device, pad_slot: int = 0
    ) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        buffers = DecodeBuffers(
            input_ids=zeros(max_size),
            positions=zeros(max_size),
            slot_mapping=zeros(max_size),
            context_lens=zeros(max_size, dtype=torch.int32),
            block_tables=zeros(max_size, max_blocks, dtype=torch.int32),
            logits_indices=torch.arange(max_size, device=device),
            state_slots=zeros(max_size, dtype=torch.int32),
            state_init=zeros(max_size, dtype=torch.int32),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            lora_slots=zeros(max_size),
            pad_slot=pad_slot,
        )
        buffers.pad(0)
        return buffers

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def view(self, size: int) -> DecodeBuffers:
        return DecodeBuffers(
            self.input_ids[:size],
            self.positions[:size],
            self.slot_mapping[:size],
            self.context_lens[:size],
            self.block_tables[:size],
            self.logits_indices[:size],
            self.state_slots[:size],
            self.state_init[:size],
            self.query_start_loc[: size + 1],
            self.lora_slots[:size],
            self.pad_slot,
        )

    def pad(self, start: int) -> None:
        """Rows `start...` become padding: no cache write, no key attended."""
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.slot_mapping[start:] = -1
        self.context_lens[start:] = 0
        self.state_slots[start:] = self.pad_slot
        self.state_init[start:] = 0
        self.lora_slots[start:] = -1

    def fill(
        self, step: StepInputs, states: StateRows = ((), ()), lora_slots: Sequence[int] = ()
    ) -> None:
        """Copy a decode-only step into the first rows, pad the rest. Device-to-device copies
        and non-blocking host copies (the context lengths; a hybrid model's `states`: each
        request's state slot and whether it continues from it; each row's adapter slot): no
        synchronization.

        NOTE: block-table columns past a row's own blocks keep stale ids; the kernels never
        read past a row's context length."""
        n = len(step.context_lens)
        width = step.block_tables.shape[1]
        assert n <= self.size and width <= self.block_tables.shape[1]
        device = self.input_ids.device
        self.input_ids[:n].copy_(step.input_ids, non_blocking=True)
        self.positions[:n].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(step.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(step.block_tables, non_blocking=True)
        pinned = device.type == "cuda"
        ctx = host_tensor(step.context_lens, torch.int32, pin=pinned)
        self.context_lens[:n].copy_(ctx, non_blocking=True)
        slots, continues = states
        if slots:
            rows = host_tensor([list(slots), [int(c) for c in continues]], torch.int32, pinned)
            self.state_slots[:n].copy_(rows[0], non_blocking=True)
            self.state_init[:n].copy_(rows[1], non_blocking=True)
        if lora_slots:
            lora = host_tensor(list(lora_slots), torch.int64, pinned)
            self.lora_slots[:n].copy_(lora, non_blocking=True)
        else:
            self.lora_slots[:n] = -1
        self.pad(n)


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """Captures a function into a replayable graph; `CudaGraphBackend` on a GPU."""

    def new_pool(self) -> Any: ...

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Graph, torch.Tensor]:
        """(graph, the output tensor that every replay rewrites)."""
        ...


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph`s sharing one memory pool (the GPU-only part of this module)."""

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Graph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out


GraphForward = Callable[[DecodeBuffers], torch.Tensor]  # buffers of s rows -> (s, vocab)


class CudaGraphRunner:
    """Decode steps through captured graphs: `capture()` once, then `can_run` / `run`."""

    def __init__(
        self,
        forward: GraphForward,
        buffers: DecodeBuffers,
        sizes: list[int],
        backend: GraphBackend | None = None,
    ) -> None:
        assert sizes == sorted(sizes) and sizes[-1] <= buffers.size
        self.forward = forward
        self.buffers = buffers
        self.sizes = sizes
        self.backend = backend or CudaGraphBackend()
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first: its graph sizes the shared pool, the smaller ones fit in it."""
        pool = self.backend.new_pool()
        for size in reversed(self.sizes):
            view = self.buffers.view(size)
            self.forward(view)  # warm-up: lazy initialization and kernel compilation
            self.graphs[size] = self.backend.capture(functools.partial(self.forward, view), pool)

    def can_run(self, step: StepInputs) -> bool:
        """A decode-only step (one token per request, each sampled) that fits a graph."""
        n = len(step.context_lens)
        return (
            bool(self.graphs)
            and step.num_decodes == n
            and n <= self.sizes[-1]
            and step.logits_indices.shape[0] == n
        )

    def run(
        self, step: StepInputs, states: StateRows = ((), ()), lora_slots: Sequence[int] = ()
    ) -> torch.Tensor:
        """(n, vocab) logits of the step's `n` decodes (`states`: a hybrid model's state slots
        and continue flags, one per request; `lora_slots`: each row's adapter slot)."""
        n = len(step.context_lens)
        size = padded_size(n, self.sizes)
        assert size is not None and self.can_run(step) and len(lora_slots) in (0, n)
        self.buffers.fill(step, states, lora_slots)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]


class Runner(Protocol):
    """What the graphs need of the model runner (worker/model_runner.py builds them)."""

    config: EngineConfig
    device: torch.device
    backend: Any
    block_size: int
    kv_caches: list[torch.Tensor]
    states: list[Any]  # a hybrid model's state pools (`state_pool_slots` slots each)
    model: Any
    lora: Any  # LoRA's device pool (lora/slots.py `LoraSlots`), or None

    def rotations(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


def may_capture(config: EngineConfig, device: torch.device) -> bool:
    """Whether decode graphs may run: a CUDA device, not `enforce_eager`."""
    return device.type == "cuda" and not config.enforce_eager


def state_pool_slots(config: EngineConfig, device: torch.device) -> int:
    """A hybrid model's state slots per linear layer: the requests' (`num_state_slots`), and
    where graphs may run one more, the scratch slot their padding rows read and write."""
    slots = config.cache.num_state_slots or 0
    return slots + 1 if slots and may_capture(config, device) else slots


def create_graph_runner(runner: Runner) -> CudaGraphRunner | None:
    """The runner's decode graphs: on a CUDA device with a backend that can build decode
    metadata from device buffers (the Triton ones, MLA's included), unless `enforce_eager`.
    Not captured yet. A hybrid model's graphs take each row's state slot from a buffer too."""
    config, backend = runner.config, runner.backend
    decode_metadata = getattr(backend, "decode_metadata", None)
    if not may_capture(config, runner.device) or decode_metadata is None:
        return None
    if config.model.hybrid is not None and not runner.states:
        return None
    from pagedllm.layers.attention.triton_launch import num_decode_splits
    from pagedllm.layers.gdn_meta import GdnMeta
    from pagedllm.model.decoder import ForwardContext
    from pagedllm.model.gdn_block import GdnStep

    sizes = capture_sizes(max_decode_rows(config))  # speculative verification's rows too
    max_len = config.scheduler.max_model_len
    max_blocks = -(-max_len // runner.block_size)
    pad_slot = config.cache.num_state_slots or 0  # the scratch slot past the requests'
    buffers = DecodeBuffers.allocate(sizes[-1], max_blocks, runner.device, pad_slot)
    local = runner.model.config  # the shard's
    programs = local.num_kv_heads  # per decode row: one per KV head (paged decode) ...
    if local.mla is not None:  # ... or per group of query heads (latent attention)
        from pagedllm.layers.attention.mla_backend import head_groups

        programs = head_groups(local.num_heads)
    kernel_config = backend.kernel_config(runner.device)

    def forward(b: DecodeBuffers) -> torch.Tensor:
        # NOTE: split-K is fixed per graph, for the longest possible context
        splits = num_decode_splits(b.size, programs, max_len, kernel_config)
        meta = decode_metadata(b.slot_mapping, b.block_tables, b.context_lens, splits)
        ctx = ForwardContext(runner.rotations(b.positions), runner.kv_caches, backend, meta)
        if runner.states:  # the recurrent decode step, one token per row, slots from buffers
            gdn = GdnMeta(b.query_start_loc, b.state_slots, b.state_init, (), (), (), b.size, 1)
            ctx = ctx._replace(gdn=GdnStep(gdn, runner.states))
        if runner.lora is not None:  # every slot's deltas, each row's slot from a buffer
            ctx = ctx._replace(lora=runner.lora.graph_step(b.lora_slots))
        logits: torch.Tensor = runner.model(b.input_ids, ctx, b.logits_indices)
        return logits

    return CudaGraphRunner(forward, buffers, sizes)
