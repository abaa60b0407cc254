"""CUDA graphs for latent-attention (DeepSeek-V3) and hybrid (Qwen3.5) models
(worker/cuda_graphs.py): the state-slot buffers and their padding (the scratch slot), and on
the CPU whole greedy generations whose decode steps run through the graph runner, with a fake
graph backend that replays by re-running the captured function on the static buffers and the
Triton kernels run by the interpreter: the ids equal the eager CPU engine's. The `gpu` test
compares real graphs with eager steps on a CUDA device (skipped here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hybrid_models import make_checkpoints
from test_cuda_graphs import FakeGraph, FakeGraphBackend, decode_step
from test_mla import make_checkpoint

from conftest import TINY, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.worker import cuda_graphs
from pagedllm.worker.cuda_graphs import DecodeBuffers, state_pool_slots


def test_buffers_carry_state_slots_and_pad_to_the_scratch_slot() -> None:
    buffers = DecodeBuffers.allocate(8, 4, torch.device("cpu"), pad_slot=6)
    assert buffers.state_slots.tolist() == [6] * 8  # captured with padding rows only
    buffers.fill(decode_step([5, 9, 1]), ([2, 0, 5], [True, False, True]))
    view = buffers.view(4)
    assert view.state_slots.tolist() == [2, 0, 5, 6]
    assert view.state_init.tolist() == [1, 0, 1, 0]
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert view.state_slots.data_ptr() == buffers.state_slots.data_ptr()
    buffers.fill(decode_step([3]), ([4], [True]))  # a smaller step pads the rest again
    assert buffers.state_slots.tolist() == [4, 6, 6, 6, 6, 6, 6, 6]
    assert buffers.state_init.tolist() == [1, 0, 0, 0, 0, 0, 0, 0]


def test_state_pool_has_a_scratch_slot_where_graphs_may_run() -> None:
    def slots(device: str, eager: bool, num: int | None) -> int:
        config: Any = SimpleNamespace(
            enforce_eager=eager, cache=SimpleNamespace(num_state_slots=num)
        )
        return state_pool_slots(config, torch.device(device))

    assert slots("cuda", False, 8) == 9
    assert slots("cuda", True, 8) == slots("cpu", False, 8) == 8
    assert slots("cuda", False, None) == 0  # no hybrid model: no pool


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph-models")
    hybrid = make_checkpoints(root / "hybrid")
    return {"mla": make_checkpoint(root / "mla"), "hybrid": next(iter(hybrid.values()))}


def generate(path: Path, **kw: Any) -> tuple[list[list[int]], LLM]:
    """Greedy ids of 6 prompts whose lengths end at different steps (decode batches shrink)."""
    prompts = random_prompts(6, (3, 30), TINY["vocab_size"], seed=4)
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(6)
    ]
    llm = LLM(str(path), max_num_seqs=8, enable_prefix_caching=False, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("kind", ["mla", "hybrid"])
def test_graph_steps_generate_as_eager(
    kind: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph runner's forward (decode metadata from the buffers, the latent write and
    decode in Triton kernels; the recurrent step's slots from the buffers, padding rows in the
    scratch slot) captured and replayed on the CPU: the same ids as the eager engine."""
    eager, _ = generate(models[kind])
    monkeypatch.setattr(cuda_graphs, "may_capture", lambda config, device: True)
    monkeypatch.setattr(cuda_graphs, "CudaGraphBackend", FakeGraphBackend)
    ids, llm = generate(models[kind], attention_backend="triton")
    graphs = llm.engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    replays = [g.replays for g, _ in graphs.graphs.values() if isinstance(g, FakeGraph)]
    assert sum(replays) >= 10 and sum(r > 0 for r in replays) >= 3
    assert ids == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["mla", "hybrid"])
def test_gpu_graphs_generate_as_eager(kind: str, models: dict[str, Path]) -> None:
    """Real CUDA graphs == eager steps on the device == the CPU, greedy ids."""
    graphs, _ = generate(models[kind], device="cuda")
    assert graphs == generate(models[kind], device="cuda", enforce_eager=True)[0]
    assert graphs == generate(models[kind], device="cpu")[0]
