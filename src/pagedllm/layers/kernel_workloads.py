"""The kernel workloads the compile check records and the GPU check runs: the attention of each
kind of layer (window, soft-cap, sinks) of each model shape we claim, per dtype, over one step's
metadata as the model runner and the graph runner build it, and the bitmask launch. Built on
any device, with zeros (recording: nothing runs) or random values (the GPU check compares them
with the reference backend)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagedllm.layers.attention.base import AttnLayer, StepInputs

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


GLOBAL = ((None, None),)  # every layer global, no soft-cap


@dataclass(frozen=True)
class Geometry:
    """The attention shape of a model class we claim: query heads, KV heads, head dim, the
    kinds of its layers, (sliding window, logit soft-cap) each, and whether every layer has
    attention sinks (gpt-oss)."""

    model: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: tuple[tuple[int | None, float | None], ...] = GLOBAL
    sinks: bool = False

    def label(self) -> str:
        """Its kinds of layers: "window 4096+softcap 50 / softcap 50"."""
        kinds = []
        for window, softcap in self.layers:
            parts = [f"window {window}"] if window else []
            parts += [f"softcap {softcap:g}"] if softcap else []
            parts += ["sinks"] if self.sinks else []
            kinds.append("+".join(parts) or "global")
        return " / ".join(kinds)


def alternating(
    window: int, softcap: float | None = None
) -> tuple[tuple[int | None, float | None], ...]:
    """The two kinds of layers of a model with windowed and global ones (Gemma 2 alternates
    them, Gemma 3 has five windowed layers per global one)."""
    return ((window, softcap), (None, softcap))


# head dims 64 / 80 / 96 / 128 / 256, GQA groups 1 to 8, windowed, soft-capped and sink layers
GEOMETRIES = (
    Geometry("SmolLM2-135M", 9, 3, 64),
    Geometry("Qwen2-0.5B", 14, 2, 64),
    Geometry("TinyLlama-1.1B", 32, 4, 64),
    Geometry("phi-2", 32, 32, 80),
    Geometry("Phi-3-mini", 32, 32, 96),
    Geometry("Llama-2-7B", 32, 32, 128),
    Geometry("Llama-3-8B", 32, 8, 128),
    Geometry("Qwen2-7B", 28, 4, 128),
    Geometry("Qwen3-0.6B", 16, 8, 128),
    Geometry("SmolLM3-3B", 16, 4, 128),
    Geometry("Llama-3-70B", 64, 8, 128),
    Geometry("Mistral-7B", 32, 8, 128, ((4096, None),)),
    Geometry("Gemma-2-2B", 8, 4, 256, alternating(4096, 50.0)),
    Geometry("Gemma-2-27B", 32, 16, 128, alternating(4096, 50.0)),
    Geometry("Gemma-3-270M", 4, 1, 256, alternating(512)),
    Geometry("Gemma-3-4B", 8, 4, 256, alternating(1024)),
    Geometry("Gemma-3-27B", 32, 16, 128, alternating(1024)),
    Geometry("gpt-oss-20b", 64, 8, 64, alternating(128), sinks=True),
)
BLOCK_SIZE = 16
VOCAB = 49152  # SmolLM2's: the bitmask launch


@dataclass
class AttentionCase:
    """A step's backend calls, one per kind of layer over the step's one metadata: the step,
    its q / new keys-values (views of one qkv projection, as the model makes them) and a
    head-major cache. `splits` None: the backend builds the step's metadata (the eager path);
    else the graph runner's decode metadata with that split count."""

    label: str
    step: StepInputs
    q: torch.Tensor
    kv: torch.Tensor
    cache: torch.Tensor
    layers: tuple[AttnLayer, ...]
    splits: int | None


def make_step(requests: list[tuple[int, int]], device: str = "cpu") -> tuple[StepInputs, int]:
    """A step of (cached prefix, new tokens) requests, decodes (1 new token) first, with
    consecutive blocks; also the number of blocks used."""
    tables: list[list[int]] = []
    slots: list[int] = []
    starts, ctx, used = [0], [], 0
    for prefix, new in requests:
        end = prefix + new
        table = list(range(used, used + -(-end // BLOCK_SIZE)))
        used += len(table)
        tables.append(table)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(prefix, end)]
        starts.append(starts[-1] + new)
        ctx.append(end)
    width = max(len(t) for t in tables)
    n = starts[-1]
    step = StepInputs(
        input_ids=torch.zeros(n, dtype=torch.long, device=device),
        positions=torch.zeros(n, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=starts,
        context_lens=ctx,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        num_decodes=sum(new == 1 for _, new in requests),
        logits_indices=torch.tensor(starts[1:], device=device) - 1,
        block_size=BLOCK_SIZE,
    )
    return step, used


# decodes (a short, a long and a first-token context), then a prefill chunk over a prefix
MIXED = [(300, 1), (4000, 1), (0, 1), (100, 70)]
DECODES = MIXED[:3]


def attention_cases(
    geo: Geometry,
    dtype: torch.dtype,
    device: str = "cpu",
    max_splits: int = 16,
    generator: torch.Generator | None = None,
) -> Iterator[AttentionCase]:
    """The mixed step (eager), then the decodes alone for every split count a graph can fix
    (1, 2, ... `max_splits`). Random values with a `generator`, else zeros."""
    from pagedllm.layers.attention.base import split_qkv
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    def values(*shape: int) -> torch.Tensor:
        if generator is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.randn(shape, device=device, generator=generator).to(dtype)

    layout = TritonAttentionBackend().kv_cache_shape
    name = f"{geo.model} {_short(dtype)}"
    sinks = None
    if geo.sinks:  # fp32 whatever the dtype, as the model keeps them
        sinks = torch.zeros(geo.heads, device=device)
        if generator is not None:
            sinks = torch.randn(geo.heads, device=device, generator=generator) * 2 + 2
    layers = tuple(AttnLayer(geo.head_dim**-0.5, w, c, sinks) for w, c in geo.layers)
    # max_splits is a power of two: 1, 2, 4, ... max_splits
    for splits in [None, *(1 << i for i in range(max_splits.bit_length()))]:
        step, blocks = make_step(MIXED if splits is None else DECODES, device)
        cache = values(*layout(blocks, BLOCK_SIZE, geo.kv_heads, geo.head_dim))
        qkv = values(step.query_start_loc[-1], geo.heads + 2 * geo.kv_heads, geo.head_dim)
        q, kv = split_qkv(qkv, geo.heads, geo.kv_heads)
        label = f"{name} mixed" if splits is None else f"{name} decode x{splits}"
        yield AttentionCase(label, step, q, kv, cache, layers, splits)


def run_case(backend: object, case: AttentionCase) -> list[torch.Tensor]:
    """The Triton backend's output for each of the case's layers, through the path the case
    names (each layer writes the same keys and values into the cache again)."""
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    assert isinstance(backend, TritonAttentionBackend)
    step = case.step
    if case.splits is None:
        meta = backend.build_metadata(step)
    else:
        meta = backend.decode_metadata(
            step.slot_mapping,
            step.block_tables.int(),
            torch.tensor(step.context_lens, dtype=torch.int32, device=step.block_tables.device),
            case.splits,
        )
    return [backend.forward(case.q, case.kv, case.cache, meta, layer) for layer in case.layers]


def bitmask_launches(device: str = "cpu") -> None:
    from pagedllm.layers.bitmask_kernel import apply_bitmask_triton

    logits = torch.zeros(4, VOCAB, device=device)
    bitmask = torch.zeros(4, (VOCAB + 31) // 32, dtype=torch.int32)
    apply_bitmask_triton(logits, bitmask, [0, 2])


def _short(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def attention_workloads(device: str = "cpu") -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, a function making the workload's launches on `device`): the same on every
    architecture (the launch table does not depend on it); the other kernels' follow in
    layers/all_workloads.py."""
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    for geo in GEOMETRIES:
        for dname, dtype in DTYPES.items():

            def run(geo: Geometry = geo, dtype: torch.dtype = dtype) -> None:
                backend = TritonAttentionBackend()
                cases = attention_cases(geo, dtype, device, backend.config.max_splits)
                for case in cases:
                    run_case(backend, case)

            yield f"{geo.model} {dname} hd{geo.head_dim} {geo.label()}", run
    yield "bitmask fp32", lambda: bitmask_launches(device)
