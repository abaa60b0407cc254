"""The GPU glue without a GPU: CUDA-graph batch sizes, padding, selection and capture order
(through a fake graph backend that replays by re-running the captured function on the static
buffers), KV-pool sizing from device memory, lazy GPU imports. The `gpu` tests at the end need
a CUDA device and are skipped here."""

from __future__ import annotations

import gc
import inspect
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedllm.config import ConfigError, EngineConfig, ModelConfig
from pagedllm.kv_budget import activation_reserve, device_kv_cache_budget
from pagedllm.layers.attention import StepInputs
from pagedllm.worker.cuda_graphs import (
    CudaGraphRunner,
    DecodeBuffers,
    capture_sizes,
    create_graph_runner,
    padded_size,
)

GIB = 1 << 30


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(64)[-3:] == [48, 56, 64]
    sizes = capture_sizes(10_000)
    assert sizes[-1] == 512 and len(sizes) == 3 + 64


def test_padded_size() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert padded_size(17, sizes) is None


def decode_step(contexts: list[int], block_size: int = 4, seed: int = 0) -> StepInputs:
    """A decode-only step: request r has `contexts[r]` tokens after this step."""
    gen = torch.Generator().manual_seed(seed)
    n = len(contexts)
    widths = [-(-c // block_size) for c in contexts]
    tables = torch.zeros(n, max(widths), dtype=torch.int64)
    for r, w in enumerate(widths):
        tables[r, :w] = torch.randint(0, 100, (w,), generator=gen)
    positions = torch.tensor(contexts) - 1
    rows = torch.arange(n)
    return StepInputs(
        input_ids=torch.randint(2, 50, (n,), generator=gen),
        positions=positions,
        slot_mapping=tables[rows, positions // block_size] * block_size + positions % block_size,
        query_start_loc=list(range(n + 1)),
        context_lens=contexts,
        block_tables=tables,
        num_decodes=n,
        logits_indices=torch.arange(n),
        block_size=block_size,
    )


def test_buffers_fill_and_pad() -> None:
    buffers = DecodeBuffers.allocate(8, 5, torch.device("cpu"))
    assert buffers.slot_mapping.eq(-1).all() and buffers.context_lens.eq(0).all()
    long = decode_step([17, 9, 3, 20, 1], seed=1)
    buffers.fill(long)
    short = decode_step([6, 2], seed=2)
    buffers.fill(short)
    assert torch.equal(buffers.input_ids[:2], short.input_ids)
    assert torch.equal(buffers.positions[:2], short.positions)
    assert torch.equal(buffers.slot_mapping[:2], short.slot_mapping)
    assert buffers.context_lens[:2].tolist() == [6, 2]
    assert torch.equal(buffers.block_tables[:2, :2], short.block_tables.int())
    # the rows the long step used are padding again: nothing written, nothing attended
    assert buffers.slot_mapping[2:].eq(-1).all() and buffers.context_lens[2:].eq(0).all()
    assert buffers.input_ids[2:].eq(0).all() and buffers.positions[2:].eq(0).all()
    view = buffers.view(4)
    assert view.size == 4 and view.input_ids.data_ptr() == buffers.input_ids.data_ptr()
    assert view.logits_indices.tolist() == [0, 1, 2, 3]


class FakeGraph:
    """Replays by running the captured function again and writing into its first output, as
    a CUDA graph rewrites the same output tensor."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out = fn, out
        self.replays = 0

    def replay(self) -> None:
        with torch.inference_mode():  # as ModelRunner.execute runs
            self.out.copy_(self.fn())
        self.replays += 1


class FakeGraphBackend:
    def __init__(self) -> None:
        self.pools: list[object] = []
        self.captured: list[tuple[int, object]] = []

    def new_pool(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[FakeGraph, torch.Tensor]:
        out = fn()
        self.captured.append((out.shape[0], pool))
        return FakeGraph(fn, out), out


def toy_forward(calls: list[int]) -> Callable[[DecodeBuffers], torch.Tensor]:
    """A stand-in for the model that depends on every input buffer: (size, 2) 'logits'."""

    def forward(b: DecodeBuffers) -> torch.Tensor:
        calls.append(b.size)
        first = b.input_ids * 1000 + b.positions * 10 + b.context_lens
        second = b.slot_mapping * 7 + b.block_tables.sum(1) + b.logits_indices
        return torch.stack([first, second], 1).float()

    return forward


def expected_toy(step: StepInputs) -> torch.Tensor:
    ctx = torch.tensor(step.context_lens)
    first = step.input_ids * 1000 + step.positions * 10 + ctx
    second = step.slot_mapping * 7 + step.block_tables.sum(1) + torch.arange(len(ctx))
    return torch.stack([first, second], 1).float()


def make_runner(max_num_seqs: int) -> tuple[CudaGraphRunner, FakeGraphBackend, list[int]]:
    sizes = capture_sizes(max_num_seqs)
    backend, calls = FakeGraphBackend(), []
    buffers = DecodeBuffers.allocate(sizes[-1], 8, torch.device("cpu"))
    return CudaGraphRunner(toy_forward(calls), buffers, sizes, backend), backend, calls


def test_capture_largest_first_in_one_pool() -> None:
    runner, backend, calls = make_runner(20)
    runner.capture()
    assert [size for size, _ in backend.captured] == [24, 16, 8, 4, 2, 1]
    assert len(backend.pools) == 1 and all(pool is backend.pools[0] for _, pool in backend.captured)
    # each capture is preceded by a warm-up run of the same size
    assert calls == [24, 24, 16, 16, 8, 8, 4, 4, 2, 2, 1, 1]
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16, 24]


@pytest.mark.parametrize("contexts", [[5], [5, 9, 1], [4, 4, 4, 4, 4], [3] * 17, [30, 2] * 12])
def test_replay_pads_and_selects_the_smallest_graph(contexts: list[int]) -> None:
    runner, _, _ = make_runner(24)
    runner.capture()
    for seed in range(2):  # the second step reuses the buffers the first one filled
        step = decode_step(contexts, seed=seed)
        assert runner.can_run(step)
        out = runner.run(step)
        assert torch.equal(out, expected_toy(step))
        size = padded_size(len(contexts), runner.sizes)
        graph, graph_out = runner.graphs[size]  # type: ignore[index]
        assert isinstance(graph, FakeGraph) and graph.replays == seed + 1
        # the padding rows ran with token 0, position 0, context 0 and slot -1
        pad = graph_out[len(contexts) :]
        assert pad[:, 0].eq(0).all()
        assert torch.equal(pad[:, 1], -7.0 + torch.arange(len(contexts), size))


def test_which_steps_can_run() -> None:
    runner, _, _ = make_runner(8)
    step = decode_step([4, 5])
    assert not runner.can_run(step)  # nothing captured yet
    runner.capture()
    assert runner.can_run(step)
    assert not runner.can_run(decode_step([3] * 9))  # larger than every graph
    mixed = decode_step([4, 5])
    mixed.num_decodes = 1  # the second request is a prefill chunk
    assert not runner.can_run(mixed)
    unsampled = decode_step([4, 5])
    unsampled.logits_indices = torch.tensor([0])  # a one-token chunk inside a prompt
    assert not runner.can_run(unsampled)


def test_no_graphs_on_the_cpu_or_when_eager() -> None:
    def runner(device: str, enforce_eager: bool, backend: object) -> Any:
        config = SimpleNamespace(enforce_eager=enforce_eager)
        return SimpleNamespace(device=torch.device(device), config=config, backend=backend)

    with_metadata = SimpleNamespace(decode_metadata=lambda *a: None)
    assert create_graph_runner(runner("cpu", False, with_metadata)) is None
    assert create_graph_runner(runner("cuda", True, with_metadata)) is None
    assert create_graph_runner(runner("cuda", False, SimpleNamespace())) is None  # torch backend


# --- KV pool sizing from device memory -------------------------------------------------------


def test_device_kv_cache_budget() -> None:
    # 80 GiB device, 90 %: 72 GiB, less 1 GiB used elsewhere, 16 GiB weights, 4 GiB activations
    budget = device_kv_cache_budget(79 * GIB, 80 * GIB, 0.9, 16 * GIB, 4 * GIB)
    assert budget == 51 * GIB
    with pytest.raises(ConfigError, match="no device memory left"):
        device_kv_cache_budget(10 * GIB, 80 * GIB, 0.9, 16 * GIB, 4 * GIB)


def test_num_parameters_matches_the_checkpoint(checkpoints: dict[str, Path]) -> None:
    from conftest import hf_model

    for arch, path in checkpoints.items():
        expected = sum(p.numel() for p in hf_model(path).parameters())
        assert ModelConfig.from_model_dir(path).num_parameters == expected, arch


def fake_cuda(monkeypatch: pytest.MonkeyPatch, free: int, total: int) -> None:
    """A CUDA device as torch would report one (resolve_device asks), with this much memory."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU")


def test_kv_pool_sized_from_free_device_memory(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoints["llama"]
    cpu = EngineConfig.create(path, max_model_len=512, kv_cache_memory=1 << 20, device="cpu")
    assert cpu.cache.num_kv_blocks == (1 << 20) // (2 * 2 * 16 * 2 * 16 * 4)  # memory-bound
    assert cpu.gpu_memory_utilization == 0.9 and not cpu.enforce_eager

    model = ModelConfig.from_model_dir(path)
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    # a device with room for the weights, the activation reserve and 7 KV blocks, of which
    # 100 bytes are already used by someone else
    total = model.num_parameters * 4 + activation_reserve(model, 2048, 4) + 7 * per_block + 100
    fake_cuda(monkeypatch, total - 100, total)
    gpu = EngineConfig.create(
        path, device="cuda", gpu_memory_utilization=1.0, max_num_seqs=4, enforce_eager=True
    )
    assert gpu.cache.num_kv_blocks == 7
    assert gpu.enforce_eager and gpu.device == "cuda:0"
    with pytest.raises(ConfigError, match="no device memory left"):
        EngineConfig.create(path, device="cuda", gpu_memory_utilization=0.5, max_num_seqs=4)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig.create(path, gpu_memory_utilization=1.5)


def test_llm_takes_vllms_gpu_knobs(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LLM(...)` passes `gpu_memory_utilization` and `enforce_eager` on, with vLLM's defaults;
    a utilization out of range is refused as such before a GPU's KV pool is sized (not as "no
    device memory left")."""
    from pagedllm.llm import LLM

    params = inspect.signature(LLM).parameters
    assert params["gpu_memory_utilization"].default == 0.9
    assert params["enforce_eager"].default is False
    path = checkpoints["llama"]
    llm = LLM(str(path), device="cpu", gpu_memory_utilization=0.5, enforce_eager=True)
    assert llm.engine.config.gpu_memory_utilization == 0.5 and llm.engine.config.enforce_eager
    fake_cuda(monkeypatch, 80 * GIB, 80 * GIB)
    for bad in (0, 1.01):
        with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
            LLM(str(path), device="cuda", gpu_memory_utilization=bad)


def test_gpu_code_is_imported_lazily() -> None:
    code = (
        "import sys, pagedllm, pagedllm.llm, pagedllm.worker.model_runner, "
        "pagedllm.worker.cuda_graphs\n"
        "from pagedllm.layers.attention import create_attention_backend\n"
        "create_attention_backend('torch')\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert 'pagedllm.layers.attention.triton_backend' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("split", [False, True])
def test_gpu_compiled_kernels_match_reference(
    dtype: torch.dtype, window: int | None, softcap: float | None, split: bool
) -> None:
    """The compiled kernels (tensor-core dots in bf16/fp16) on the GPU. NOTE: run the `gpu`
    tests in a pytest process without test_triton_kernels.py, whose interpreter set-up would
    break compiled launches after it (see docs/gpu.md)."""
    from test_triton_kernels import ATOL, make_step, to_head_major

    from pagedllm.layers.attention.base import AttnLayer
    from pagedllm.layers.attention.torch_ref import TorchAttentionBackend
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
    from pagedllm.layers.attention.triton_launch import KernelConfig

    requests = [(0, 1), (8, 1), (700, 1), (11, 90), (0, 200), (300, 37)]
    step, num_blocks = make_step(requests, 16)
    step = StepInputs(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(step).items()})
    gen = torch.Generator("cuda").manual_seed(0)
    n, heads, kv_heads, hd = len(step.positions), 28, 4, 128
    cache = torch.randn(num_blocks, 16, 2, kv_heads, hd, device="cuda", generator=gen).to(dtype)
    qkv = torch.randn(n, heads + 2 * kv_heads, hd, device="cuda", generator=gen).to(dtype)
    q, kv = qkv[:, :heads], qkv[:, heads:].view(n, 2, kv_heads, hd)
    layer = AttnLayer(hd**-0.5, window, softcap)
    ref, ref_cache = TorchAttentionBackend(), cache.clone()
    expected = ref.forward(q, kv, ref_cache, ref.build_metadata(step), layer)
    cfg = KernelConfig(min_split_tokens=64 if split else 1 << 20)
    backend, tri_cache = TritonAttentionBackend(cfg), to_head_major(cache)
    out = backend.forward(q, kv, tri_cache, backend.build_metadata(step), layer)
    assert torch.equal(tri_cache, to_head_major(ref_cache))
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graphs_generate_as_eager(checkpoints: dict[str, Path]) -> None:
    """Greedy ids through CUDA graphs (Triton backend) == eager reference backend on the GPU
    == the CPU, for a batch whose decode sizes shrink as requests finish."""
    from conftest import random_prompts
    from pagedllm.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    path = str(checkpoints["llama"])
    prompts = [{"prompt_token_ids": p} for p in random_prompts(11, (3, 40), 384)]
    params = [
        SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(11)
    ]

    def ids(**kw: Any) -> list[list[int]]:
        outs = LLM(path, max_num_seqs=16, **kw).generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        return [list(o.outputs[0].token_ids) for o in outs]

    graphs = ids(device="cuda")
    assert graphs == ids(device="cuda", attention_backend="torch")
    assert graphs == ids(device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kv_pool_from_real_free_memory(checkpoints: dict[str, Path]) -> None:
    """On the device: a utilization leaving room for ~20000 KV blocks (160 MiB) beyond what is
    in use, the weights and the activation reserve gives about that many; an engine closed in
    this process does not count as used (its memory stays cached by torch until the next one).
    The window is wide against what the device allocates by itself (lazily loaded modules)."""
    from pagedllm.llm import LLM

    path = checkpoints["llama"]
    model = ModelConfig.from_model_dir(path)
    per_block, target, seqs = 2 * 2 * 16 * 2 * 16 * 4, 20000, 1024
    first = LLM(str(path), max_num_seqs=4)  # takes the pool as usual, then is dropped
    del first
    gc.collect()
    free, total = torch.cuda.mem_get_info()
    needed = model.num_parameters * 4 + activation_reserve(model, 2048, seqs) + target * per_block
    # what torch holds but no tensor uses (the dropped engine's pool): `create` frees it before
    # it measures; what is still allocated (cuBLAS workspaces) stays used
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    utilization = (total - free - cached + needed) / total
    # at most 1024 x 32 blocks: the budget, not this cap, decides
    cfg = EngineConfig.create(
        path, device="cuda", gpu_memory_utilization=utilization, max_num_seqs=seqs
    )
    seen = dict(
        free=free, total=total, cached=cached, needed=needed, blocks=cfg.cache.num_kv_blocks
    )
    assert 0.8 * target <= cfg.cache.num_kv_blocks <= 1.2 * target, seen
