"""Tensor parallelism on the CPU (gloo): how models split, greedy tokens equal to HF's and
log-probs equal to one rank's within tolerance (reductions reorder: not bit-exact), through
chunked prefill, prefix hits and preemption; and the worker processes' lifecycle — a dead
worker kills the engine with a clear reason, a dead parent takes its workers with it, close
leaves none behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, hf_greedy, hf_model, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, ModelConfig
from pagedllm.distributed.shard import ShardPlan, valid_sizes
from pagedllm.engine.faults import EngineDeadError
from pagedllm.engine.service import EngineService
from pagedllm.layers.quant import quantize_int4, quantize_int8
from pagedllm.serving.settings import instance_gpus, tensor_parallel_size

SPAWN = "multiprocessing.spawn"


def _config(checkpoints: dict[str, Path], arch: str) -> ModelConfig:
    return ModelConfig.from_model_dir(checkpoints[arch])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


# --- how a model splits --------------------------------------------------------------------


def test_smollm2_shape_splits_only_three_ways(checkpoints: dict[str, Path]) -> None:
    import dataclasses

    smol = dataclasses.replace(  # SmolLM2-135M: 9 query heads, 3 KV heads, MLP 1536
        _config(checkpoints, "llama"), num_heads=9, num_kv_heads=3, intermediate_size=1536
    )
    assert valid_sizes(smol, 16) == [1, 3]  # 9 would split the heads, not the MLP
    with pytest.raises(ConfigError, match=r"9 attention heads do not split 2 ways.*: 1, 3\)"):
        ShardPlan.create(smol, 0, 2)


@pytest.mark.parametrize(("arch", "world"), [("llama", 2), ("llama", 4), ("mistral", 2)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(
    checkpoints: dict[str, Path], arch: str, world: int
) -> None:
    cfg = _config(checkpoints, arch)
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
    held = []
    for rank in range(world):
        plan = ShardPlan.create(cfg, rank, world)
        queries = range(rank * plan.num_heads, (rank + 1) * plan.num_heads)
        kv = range(plan.kv_head_start, plan.kv_head_start + plan.num_kv_heads)
        assert {q // group for q in queries} <= set(kv), (rank, plan)
        held += list(kv)
    # split when there are enough KV heads, else each replicated on world / kv_heads ranks
    assert sorted(set(held)) == list(range(cfg.num_kv_heads))
    assert len(held) == max(world, cfg.num_kv_heads)


def test_quantized_weights_split_along_whole_groups() -> None:
    w = torch.randn(6, 128)
    for q in (quantize_int8(w, 32), quantize_int4(w)):
        full = q.dequantize()
        assert torch.equal(q.narrow(0, 2, 3).dequantize(), full[2:5])
        assert torch.equal(q.narrow(1, 64, 64).dequantize(), full[:, 64:])
        with pytest.raises(ValueError, match="groups of 32"):
            q.narrow(1, 16, 64)


def test_triton_settings_for_tensor_parallelism() -> None:
    assert tensor_parallel_size({"tensor_parallel_size": "2"}, "MODEL") == 2
    with pytest.raises(ValueError, match="KIND_MODEL"):
        tensor_parallel_size({"tensor_parallel_size": "2"}, "GPU")
    assert tensor_parallel_size({}, "GPU") == 1
    assert instance_gpus({}, "llm_engine_0_0") is None
    ids = {"gpu_device_ids": "0,1;2, 3"}
    assert instance_gpus(ids, "llm_engine_0_0") == "0,1"
    assert instance_gpus(ids, "llm_engine_0_1") == "2,3"
    assert instance_gpus({"gpu_device_ids": "4,5"}, "llm_engine_0_3") == "4,5"  # one group
    two_groups = [{"count": 1, "kind": "KIND_MODEL"}, {"count": 1, "kind": "KIND_MODEL"}]
    assert instance_gpus(ids, "llm_engine_1_0", two_groups) == "2,3"  # numbered across groups
    with pytest.raises(ValueError, match="has 2 groups"):
        instance_gpus(ids, "llm_engine_0_2")
    with pytest.raises(ValueError, match="look like"):
        instance_gpus({"gpu_device_ids": "0;x"}, "llm_engine_0_0")


# --- the same tokens as one rank -------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_two_ranks_generate_hf_greedy_tokens(checkpoints: dict[str, Path], arch: str) -> None:
    """Chunked prefill (16-token chunks), prefix hits (shared 24-token prefixes) and
    preemption (a pool too small for the batch) on 2 ranks: HF's greedy tokens."""
    prefix = random_prompts(1, (24, 24), TINY["vocab_size"], seed=5)[0]
    prompts = [prefix + p for p in random_prompts(6, (3, 30), TINY["vocab_size"], seed=6)]
    max_tokens = 12
    expected = hf_greedy(hf_model(checkpoints[arch]), prompts, max_tokens, eos=None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(
        str(checkpoints[arch]),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        num_kv_blocks=24,
        block_size=4,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats


def test_log_probs_equal_one_ranks_within_tolerance(checkpoints: dict[str, Path]) -> None:
    """Sampled and prompt log-probs (the gathered logits; the prompt's through the eager
    path) of 2 ranks equal 1 rank's to 1e-4: the sums are split and reordered."""
    prompts = random_prompts(3, (8, 20), TINY["vocab_size"], seed=9)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2)
    runs = []
    for world in (1, 2):
        with LLM(
            str(checkpoints["qwen2"]), dtype="float32", device="cpu", tensor_parallel_size=world
        ) as llm:
            runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, False))
    assert_same_tokens_and_log_probs(*runs)


def assert_same_tokens_and_log_probs(ones: list, twos: list, tolerance: float = 1e-4) -> None:
    """Two runs' outputs of the same requests: the same tokens, and their sampled and prompt
    log-probs (the top ones of each position) within `tolerance`."""
    for one, two in zip(ones, twos, strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        pairs = [
            (a[t].logprob, b[t].logprob)
            for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True)
            for t in a
        ]
        pairs += [
            (a[t].logprob, b[t].logprob)
            for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True)
            for t in a
        ]
        assert len(pairs) > 20
        assert max(abs(x - y) for x, y in pairs) < tolerance


# --- the workers' lifecycle --------------------------------------------------------------------


def test_a_dead_worker_kills_the_engine_with_its_reason(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", tensor_parallel_size=2)
    workers = llm.engine.runner.workers
    assert workers is not None
    [pid] = workers.pids
    service = EngineService(llm.engine).start()
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while service.healthy and time.monotonic() < deadline:  # seen while idle
            time.sleep(0.05)
        assert not service.healthy
        assert f"tensor-parallel worker 1 (pid {pid}) died (killed by SIGKILL)" in str(
            service.dead_reason
        )
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            service.submit("r", [5, 6, 7], SamplingParams(max_tokens=2), print, print)
    finally:
        service.shutdown(drain=False, timeout=10)
        llm.close()


def test_a_fault_in_a_step_fails_the_requests_with_the_workers_reason(
    checkpoints: dict[str, Path],
) -> None:
    """A worker killed while the engine steps: the step's collective fails at once, and
    the error names the dead worker."""
    llm = LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", tensor_parallel_size=2)
    workers = llm.engine.runner.workers
    assert workers is not None
    try:
        workers.procs.processes[1].kill()
        workers.procs.processes[1].join(5)
        with pytest.raises(EngineDeadError, match=r"worker 1 \(pid \d+\) died"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), False)
        assert "worker 1" in str(llm.engine.dead_reason)  # poisoned: it never steps again
        with pytest.raises(EngineDeadError, match="worker 1"):
            llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), False)
    finally:
        llm.close()
    assert not wait_gone(workers.pids, 5)


CHILD = """
import sys, time
from pagedllm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=4)
    print(*llm.engine.runner.workers.pids, flush=True)
    time.sleep(600)
"""


def test_workers_exit_when_their_parent_is_killed(checkpoints: dict[str, Path]) -> None:
    """The death pipe: SIGKILL leaves the parent no chance to stop them."""
    ckpt = checkpoints["mistral"]  # 1 KV head: replicated on all 4 ranks
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ckpt)], stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(p) for p in pids)
        parent.kill()
        parent.wait(10)
    assert not wait_gone(pids, 10)


def test_close_stops_every_worker(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", tensor_parallel_size=2)
    workers = llm.engine.runner.workers
    assert workers is not None
    pids = workers.pids
    assert all(alive(p) and SPAWN in Path(f"/proc/{p}/cmdline").read_text() for p in pids)
    start = time.monotonic()
    llm.close()
    assert not wait_gone(pids, 1) and time.monotonic() - start < 5
    assert all(p.exitcode == 0 for p in workers.procs.processes.values())
