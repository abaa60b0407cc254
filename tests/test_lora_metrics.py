"""vLLM's LoRA gauge as the engine states it: the adapters of the running and of the waiting
requests, and max_loras (`EngineStats.lora`, `serving.metrics`); none without LoRA. The
gauge through a real server: tests/test_lora_server.py."""

from __future__ import annotations

from pathlib import Path

from lora_adapters import save_adapter

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.stats import LoRARequestsInfo
from pagedllm.serving.metrics import MetricsExporter

GAUGE = "vllm:lora_requests_info"


def test_running_and_waiting_adapters(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """With one slot, the second adapter's request waits for it."""
    base = checkpoints["llama"]
    one_slot = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1)
    engine, params = one_slot.engine, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, name in enumerate(("mlp_o", "qv")):
        path = str(save_adapter(base, tmp_path / name, name, seed=i))
        lora = LoRARequest(name, i + 1, path)
        engine.add_request(name, "Once upon a time", params, lora_request=lora)
    engine.step()
    stats = engine.stats()
    assert stats.lora == LoRARequestsInfo(("mlp_o",), ("qv",), 1)
    gauges = [u for u in MetricsExporter().updates(stats, []) if u.name == GAUGE]
    assert [(u.kind, u.labels) for u in gauges] == [
        (
            "gauge",
            (
                ("max_lora", "1"),
                ("running_lora_adapters", "mlp_o"),
                ("waiting_lora_adapters", "qv"),
            ),
        )
    ]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().lora == LoRARequestsInfo((), (), 1)


def test_no_gauge_without_lora(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.lora is None
    assert GAUGE not in {u.name for u in MetricsExporter().updates(stats, [])}
