"""LoRA on a GPU's fast paths, checked on the CPU: decode steps with adapter tokens through the
CUDA-graph runner (worker/cuda_graphs.py; each row's adapter slot in a buffer, padding rows at
-1, the slot pool's tensors fixed in place), replayed by a fake graph backend that re-runs the
captured function on the static buffers, the BGMV launches run by the Triton interpreter:
greedy ids and log-probs equal the eager CPU engine's, through a slot swap between replays."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import ADAPTERS, save_adapter
from test_cuda_graphs import FakeGraph, FakeGraphBackend, decode_step

from conftest import TINY, make_checkpoint, random_prompts
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.slots import LoraSlots
from pagedllm.worker import cuda_graphs
from pagedllm.worker.cuda_graphs import DecodeBuffers


def test_buffers_pad_lora_rows_to_no_adapter() -> None:
    buffers = DecodeBuffers.allocate(8, 4, torch.device("cpu"))
    assert buffers.lora_slots.tolist() == [-1] * 8  # captured with padding rows only
    buffers.fill(decode_step([5, 9, 1]), lora_slots=[1, -1, 0])
    assert buffers.view(4).lora_slots.tolist() == [1, -1, 0, -1]
    assert buffers.view(4).lora_slots.data_ptr() == buffers.lora_slots.data_ptr()
    buffers.fill(decode_step([3, 2]), lora_slots=[0, 0])  # a smaller step pads the rest again
    assert buffers.lora_slots.tolist() == [0, 0] + [-1] * 6
    buffers.fill(decode_step([4]))  # no adapter in the step: the base model's rows
    assert buffers.lora_slots.tolist() == [-1] * 8


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("lora-graphs") / "base", "qwen2", seed=7)
    for i, name in enumerate(ADAPTERS):  # qv, all, mlp_o: ranks and targets differ
        save_adapter(path, path.parent / name, name, seed=10 + i)
    return path


def generate(base: Path, **kw: Any) -> tuple[list[list[int]], list[list[float]], LLM]:
    """Greedy ids and their log-probs: the base model and three adapters, two slots; the
    first two adapters' requests end early, so the third is swapped into a slot while the
    others still decode."""
    names: list[str | None] = [None, *ADAPTERS, None]
    lengths = [10, 3, 3, 8, 6]
    loras = [
        None if n is None else LoRARequest(n, i + 1, str(base.parent / n))
        for i, n in enumerate(names)
    ]
    prompts = random_prompts(len(names), (3, 20), TINY["vocab_size"], seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in lengths
    ]
    llm = LLM(str(base), max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=8, **kw)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    llm.engine.check_integrity()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = []
    for o in outs:
        sample = o.outputs[0]
        assert sample.logprobs is not None
        pairs = zip(sample.logprobs, sample.token_ids, strict=True)
        logprobs.append([lp[t].logprob for lp, t in pairs])
    return ids, logprobs, llm


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_graph_steps_with_adapters_generate_as_eager(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager_ids, eager_logprobs, _ = generate(base)
    monkeypatch.setattr(cuda_graphs, "may_capture", lambda config, device: True)
    monkeypatch.setattr(cuda_graphs, "CudaGraphBackend", FakeGraphBackend)
    # a real graph reads the pool at the addresses it was captured with: a swap-in must
    # write into the pool's tensors, never replace them
    addresses: set[tuple[int, ...]] = set()
    graph_step = LoraSlots.graph_step

    def watched(self: LoraSlots, token_slots: torch.Tensor) -> Any:
        addresses.add(tuple(t.data_ptr() for w in self.weights for p in w.values() for t in p))
        return graph_step(self, token_slots)

    monkeypatch.setattr(LoraSlots, "graph_step", watched)
    ids, logprobs, llm = generate(base, attention_backend="triton")
    assert len(addresses) == 1  # from the capture through every replay
    graphs, table = llm.engine.runner.graphs, llm.engine.runner.lora_table
    assert graphs is not None and table is not None
    replays = [g.replays for g, _ in graphs.graphs.values() if isinstance(g, FakeGraph)]
    assert sum(replays) >= 8 and sum(r > 0 for r in replays) >= 2
    assert table.num_loads == 3  # the third adapter took a slot another had held
    assert ids == eager_ids
    for got, want in zip(logprobs, eager_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graphs_with_adapters_generate_as_eager(base: Path) -> None:
    """Real CUDA graphs with adapter tokens == eager steps on the device, greedy ids and
    log-probs."""
    ids, logprobs, llm = generate(base, device="cuda")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    eager_ids, eager_logprobs, _ = generate(base, device="cuda", enforce_eager=True)
    assert ids == eager_ids
    for got, want in zip(logprobs, eager_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-3)
