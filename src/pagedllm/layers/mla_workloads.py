"""Latent attention's kernel workloads (layers/attention/triton_mla.py) that the compile check
records: the latent cache write and the absorbed decode of each DeepSeek shape we claim (HF
config: num_attention_heads, kv_lora_rank, qk_rope_head_dim), in fp16, bf16 and fp32, over a
step of decodes (a short, a long and a first-token context) through the backend's eager
metadata (the split heuristic) and a graph's decode metadata at every split count 1 ...
`max_splits`. Zeros: recording runs nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pagedllm.layers.kernel_workloads import DECODES, DTYPES, make_step

# (query heads on one rank, kv_lora_rank, qk_rope_head_dim)
MLA_SHAPES = {
    "DeepSeek-V3": (128, 512, 64),  # and R1, V3.1, V3.2's dense attention
    "DeepSeek-V2-Lite": (16, 512, 64),
}


def run_mla_decodes(heads: int, rank: int, rope: int, dtype: torch.dtype, device: str) -> None:
    """The write and the decodes of one layer, eager and for every split count a graph
    fixes."""
    from pagedllm.layers.attention.mla_backend import MlaTritonBackend

    backend = MlaTritonBackend()
    step, blocks = make_step(DECODES, device)
    cache = torch.zeros(blocks, step.block_size, rank + rope, dtype=dtype, device=device)
    new = torch.zeros(len(DECODES), rank + rope, dtype=dtype, device=device)
    query = torch.zeros(len(DECODES), heads, rank + rope, dtype=dtype, device=device)
    metas = [backend.build_metadata(step)]
    ctx = torch.tensor(step.context_lens, dtype=torch.int32, device=device)
    max_splits = backend.config.max_splits
    for splits in (1 << i for i in range(max_splits.bit_length())):
        bt = step.block_tables.int()
        metas.append(backend.decode_metadata(step.slot_mapping, bt, ctx, splits))
    for meta in metas:
        meta.write_and_decode(new, query, cache, rank, rank**-0.5)


def mla_workloads(device: str = "cpu") -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, launches) per shape and dtype, as `all_workloads.workloads` yields them."""
    for model, (heads, rank, rope) in MLA_SHAPES.items():
        for dname, dtype in DTYPES.items():

            def run(
                heads: int = heads, rank: int = rank, rope: int = rope, dtype: torch.dtype = dtype
            ) -> None:
                run_mla_decodes(heads, rank, rope, dtype, device)

            yield f"mla {model} {dname} heads{heads} rank{rank}+{rope}", run
