"""The device pool of LoRA adapters counted in the GPU's memory budget (lora/pool.py): its
bytes computed from the model's sizes equal the pool's real tensors' (one rank, two ranks), and
the KV pool gets its blocks from what is left after it (kv_budget.py's `reserved_bytes`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cuda_graphs import GIB, fake_cuda

from conftest import make_checkpoint
from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.distributed.shard import ShardPlan
from pagedllm.kv_budget import activation_reserve
from pagedllm.lora.pool import pool_bytes
from pagedllm.lora.request import LoRAConfig
from pagedllm.lora.slots import LoraSlots


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("lora-pool") / "llama", "llama")


def pool_nbytes(slots: LoraSlots) -> int:
    return sum(a.nbytes + b.nbytes for a, b in slots.pool.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_bytes_equal_the_pools_tensors(llama: Path, dtype: torch.dtype) -> None:
    cfg = ModelConfig.from_model_dir(llama)
    lora = LoRAConfig(max_loras=3, max_lora_rank=8)
    cpu = torch.device("cpu")
    assert pool_bytes(cfg, lora, dtype) == pool_nbytes(LoraSlots(lora, cfg, cpu, dtype))
    # by hand: layers x slots x R x (in + out) of q/k/v, o, gate/up and down
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    d, i = cfg.hidden_size, cfg.intermediate_size
    dims = 3 * (d + q + 2 * kv) + (q + d) + 2 * (d + 2 * i) + (i + d)
    assert pool_bytes(cfg, lora, dtype) == cfg.num_layers * 3 * 8 * dims * dtype.itemsize
    # two ranks: each holds its shard
    ranks = [LoraSlots(lora, cfg, cpu, dtype, ShardPlan.create(cfg, r, 2)) for r in range(2)]
    assert pool_bytes(cfg, lora, dtype, world=2) == max(map(pool_nbytes, ranks))
    assert pool_bytes(cfg, lora, dtype, world=2) < pool_bytes(cfg, lora, dtype)


def test_kv_pool_sized_after_the_slot_pool(
    llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A device with room for the weights, the activation reserve, the adapters' slot pool and
    7 KV blocks: 7 blocks with LoRA, the pool's worth more without."""
    path = llama
    model = ModelConfig.from_model_dir(path)
    lora = LoRAConfig(max_loras=4, max_lora_rank=16)
    pool = pool_nbytes(LoraSlots(lora, model, torch.device("cpu"), torch.float32))
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    total = model.num_parameters * 4 + activation_reserve(model, 2048, 4) + 7 * per_block + pool
    fake_cuda(monkeypatch, total, total)
    kw: dict[str, Any] = dict(device="cuda", gpu_memory_utilization=1.0, max_num_seqs=4)
    with caplog.at_level(logging.INFO, logger="pagedllm.lora.pool"):
        assert EngineConfig.create(path, lora=lora, **kw).cache.num_kv_blocks == 7
    mib = f"{pool / (1 << 20):.1f} MiB per rank"
    assert any(
        mib in r.getMessage() and "4 slots of rank 16" in r.getMessage() for r in caplog.records
    )
    assert EngineConfig.create(path, **kw).cache.num_kv_blocks == 7 + pool // per_block
    assert pool // per_block >= 10 and total < GIB
