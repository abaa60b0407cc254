"""Engine metrics (vLLM's names): counters equal what was sent and generated, histogram
observations count requests and tokens, a forced preemption is counted; the exporter turns
cumulative counts into increments."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from conftest import TINY, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.metrics import HISTOGRAMS
from pagedllm.serving.metrics import COUNTERS, GAUGES, MetricsExporter, cache_config_info


def test_counters_and_observations_under_preemption(checkpoints: dict[str, Path]) -> None:
    prompts = random_prompts(8, (10, 40), TINY["vocab_size"], seed=5)
    # 24 blocks of 4 tokens: room for ~1.5 full requests at a time, so preemptions happen
    llm = LLM(str(checkpoints["llama"]), block_size=4, num_kv_blocks=24)
    lengths = [4 + i for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    exporter = MetricsExporter()
    before = list(exporter.updates(llm.engine.stats(), llm.engine.metrics.drain()))
    assert {u.kind for u in before} == {"gauge"}  # nothing counted yet
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    stats, observations = llm.engine.stats(), llm.engine.metrics.drain()
    assert stats.num_preemptions > 0
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    assert stats.generation_tokens == sum(lengths)
    assert stats.finished == (("length", 8),)
    counts = Counter(name for name, _ in observations)
    assert counts["vllm:time_to_first_token_seconds"] == 8
    assert counts["vllm:time_per_output_token_seconds"] == sum(n - 1 for n in lengths)
    for name in ("e2e_request_latency", "request_queue_time"):
        assert counts[f"vllm:{name}_seconds"] == 8
    generated = sorted(v for n, v in observations if n == "vllm:request_generation_tokens")
    assert generated == lengths
    assert all(v >= 0 for _, v in observations)
    assert set(counts) == set(HISTOGRAMS)

    updates = list(exporter.updates(stats, observations))
    increments = {(u.name, u.labels): u.value for u in updates if u.kind == "counter"}
    assert increments[("vllm:generation_tokens_total", ())] == sum(lengths)
    assert increments[("vllm:request_success_total", (("finished_reason", "length"),))] == 8
    assert increments[("vllm:num_preemptions_total", ())] == stats.num_preemptions
    gauges = {u.name: u.value for u in updates if u.kind == "gauge"}
    assert gauges == dict.fromkeys(GAUGES, 0.0)  # all done, every block free
    assert {u.name for u in updates} <= set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS)
    # nothing new: no increments the second time
    again = list(exporter.updates(llm.engine.stats(), llm.engine.metrics.drain()))
    assert {u.kind for u in again} == {"gauge"}


def test_cache_config_info_has_vllms_labels(checkpoints: dict[str, Path]) -> None:
    """The KV pool, labelled as vLLM labels vllm:cache_config_info (its CacheConfig field
    names; the endpoint picker reads block_size and num_gpu_blocks). The pool a real server
    allocates: tests/gateway_metrics.py."""
    config = EngineConfig.create(
        checkpoints["llama"], block_size=8, num_kv_blocks=24, dtype="float32", device="cpu"
    )
    info = cache_config_info(config, 24)
    assert info["block_size"] == "8" and info["num_gpu_blocks"] == "24"
    assert info["cache_dtype"] == "float32" and info["enable_prefix_caching"] == "True"
    assert info["gpu_memory_utilization"] == "0.9" and info["engine"] == "0"
    assert all(isinstance(v, str) for v in info.values())


def test_cache_config_info_names_a_quantized_cache(checkpoints: dict[str, Path]) -> None:
    """kv_cache_dtype int8 (vLLM's int8_per_token_head): the label and the capacity line say
    so, bytes per token with the rows' scales."""
    config = EngineConfig.create(
        checkpoints["llama"], num_kv_blocks=24, kv_cache_dtype="int8_per_token_head", device="cpu"
    )
    assert cache_config_info(config, 24)["cache_dtype"] == "int8"
    # TINY llama: 2 layers, 2 KV heads of 16: 2 * 2 * 2 rows of 16 + 4 bytes
    assert config.kv_capacity_line().startswith(
        "KV cache: 24 blocks of 16 = 384 tokens, int8, 160 "
    )
