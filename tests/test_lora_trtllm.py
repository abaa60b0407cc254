"""TensorRT-LLM's LoRA rows (`lora_weights`, `lora_config`, as its hf_lora_convert.py writes
them from a PEFT folder) read into our adapter: the same tensors as the PEFT folder read by
`load_adapter`; the combined attn_qkv row; every malformed row refused by name. No server
(test_lora_server.py serves them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lora_adapters import fp16_copy, save_adapter, trtllm_rows

from pagedllm.lora.adapter import LoRAError, load_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.trtllm import adapter_from_rows
from pagedllm.model_config import ModelConfig
from pagedllm.serving.errors import RequestError

REQUEST = LoRARequest("t", 1)


@pytest.fixture(scope="module")
def folder(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-trtllm")
    peft = save_adapter(checkpoints["llama"], root / "peft", "all", seed=3)
    return fp16_copy(peft, root / "fp16")


@pytest.fixture(scope="module")
def cfg(checkpoints: dict[str, Path]) -> ModelConfig:
    return ModelConfig.from_model_dir(checkpoints["llama"])


def test_rows_read_as_the_peft_folder(folder: Path, cfg: ModelConfig) -> None:
    weights, config = trtllm_rows(folder)
    assert sorted(set(config[:, 0].tolist())) == list(range(1, 8))  # all seven modules
    ours = adapter_from_rows(weights, config, REQUEST, cfg, max_rank=8)
    peft = load_adapter(LoRARequest("t", 1, str(folder)), cfg, max_rank=8)
    assert ours.weights.keys() == peft.weights.keys() and ours.rank == peft.rank == 8
    for key, (a, b) in peft.weights.items():
        assert torch.equal(ours.weights[key][0], a), key
        assert torch.equal(ours.weights[key][1], b), key  # q/k rows interleaved alike


def test_attn_qkv_row_is_q_k_and_v_with_one_a(cfg: ModelConfig) -> None:
    gen = torch.Generator().manual_seed(0)
    r, d = 2, cfg.hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    a = torch.randn(r, d, generator=gen).half()
    bq, bk, bv = (torch.randn(n, r, generator=gen).half() for n in (q, kv, kv))
    fused = torch.cat([a.flatten(), torch.cat([bq, bk, bv]).flatten()])
    split = [torch.cat([a.flatten(), b.flatten()]) for b in (bq, bk, bv)]
    width = len(fused)
    split = [torch.nn.functional.pad(s, (0, width - len(s))) for s in split]
    one = adapter_from_rows(fused[None].numpy(), np.array([[0, 1, r]], np.int32), REQUEST, cfg, 4)
    three = adapter_from_rows(
        torch.stack(split).numpy(),
        np.array([[1, 1, r], [2, 1, r], [3, 1, r]], np.int32),
        REQUEST,
        cfg,
        4,
    )
    assert (
        one.weights.keys()
        == three.weights.keys()
        == {(1, p) for p in ("q_proj", "k_proj", "v_proj")}
    )
    for key, (a1, b1) in three.weights.items():
        assert torch.equal(one.weights[key][0], a1) and torch.equal(one.weights[key][1], b1)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda w, c: (w, c[:, :2]), "lora_config must be [N, 3]"),
        (lambda w, c: (w[:-1], c), "lora_weights must be [N, W] with N = lora_config's"),
        (lambda w, c: (w, np.where(np.arange(3) == 0, 9, c)), "module id 9 is not supported"),
        (lambda w, c: (w, np.where(np.arange(3) == 1, 99, c)), "layer 99 is not one of"),
        (
            lambda w, c: (w, np.where(np.arange(3) == 2, 16, c)),
            "adapter size 16 is not in [1, max_lora_rank 8]",
        ),
        (lambda w, c: (w[:, :100], c), "lora_weights rows hold 100"),
        (
            lambda w, c: (np.where(np.arange(w.shape[1]) == 0, np.float16("inf"), w), c),
            "is not finite",
        ),
        (lambda w, c: (np.concatenate([w, w[:1]]), np.concatenate([c, c[:1]])), "is given twice"),
        (lambda w, c: (w.astype(np.int32), c), "lora_weights must hold floats"),
    ],
)
def test_malformed_rows_are_refused_by_name(
    folder: Path, cfg: ModelConfig, edit: object, message: str
) -> None:
    weights, config = trtllm_rows(folder)
    bad_w, bad_c = edit(weights, config)  # type: ignore[operator]
    with pytest.raises(LoRAError, match=f"^t: .*{__import__('re').escape(message)}"):
        adapter_from_rows(bad_w, bad_c, REQUEST, cfg, max_rank=8)


def test_task_cache_keeps_max_cpu_loras_and_evicts_an_idle_one(
    folder: Path, cfg: ModelConfig
) -> None:
    """TensorRT-LLM's cache rules (serving/lora_tasks.py): an id alone after its rows; one
    task kept (max_cpu_loras 1): a new one waits for none, it evicts the idle one, or is
    refused while the kept one has a request in flight."""
    from pagedllm.lora.request import LoRAConfig
    from pagedllm.lora.slots import LoraSlots
    from pagedllm.serving.lora import LoRANames
    from pagedllm.serving.lora_tasks import LoraTasks

    slots = LoraSlots(LoRAConfig(1, 8, 1), cfg, torch.device("cpu"), torch.float32)
    names = LoRANames(True, {"named": str(folder)})  # id 1
    tasks = LoraTasks(slots, tensor_parallel=1, new_id=names.new_id)
    weights, config = trtllm_rows(folder)

    def send(task: int, rows: bool = True):  # type: ignore[no-untyped-def]
        tensors = {"lora_task_id": np.array([task], np.uint64)}
        if rows:
            tensors |= {"lora_weights": weights, "lora_config": config}
        return tasks.resolve(tensors.get)

    first = send(1)
    assert first is not None and first.request.lora_int_id == 2  # after the named adapter's
    assert 2 in slots.host  # pinned: no folder to read it from again
    again = send(1, rows=False)
    assert again is not None and again.request == first.request
    with pytest.raises(RequestError, match=r"LoRA cache is full .* no done tasks to evict"):
        send(2)  # task 1 has two requests in flight
    tasks.release(first)
    tasks.release(again)
    second = send(2)
    assert second is not None and 2 not in slots.host
    late = names.add("late", str(folder))  # a runtime load: one id space with the tasks'
    ids = [names.requests["named"], first.request, second.request, late]
    assert len({r.lora_int_id for r in ids}) == 4
    with pytest.raises(RequestError, match=r"^LoRA task 1 not found in cache\. Please send"):
        send(1, rows=False)
    assert tasks.resolve({}.get) is None
