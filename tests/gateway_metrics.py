"""What the Gateway API Inference Extension's endpoint picker reads from a pod, checked on
test_openai's real tritonserver and gateway (imported there, so it runs on that module's
server: no server of its own). Not a test module itself: its name has no test_ prefix."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
from docker_files import engine_pbtxt
from server_metrics import metrics

from pagedllm.serving.metrics import GAUGES
from pagedllm.serving.tritonserver import TritonServer

# The Model Server Protocol of gateway-api-inference-extension (docs/proposals/
# 003-model-server-protocol, v1.6.0): queue, running and KV usage gauges by vLLM's names, and
# the labels of vllm:cache_config_info its prefix-cache scorer reads. vLLM itself labels the
# gauge with every CacheConfig field (vllm/v1/metrics/loggers.py, log_metrics_info).
EPP_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
EPP_CACHE_LABELS = ("block_size", "num_gpu_blocks")
CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\} (\S+)$", re.M)
BLOCK_SIZE = 16  # EngineConfig's default; llm_engine's config.pbtxt sets none
FLOAT32_BYTES = 4  # the server runs the checkpoint in float32 (make_server dtype)


def expected_blocks(model_dir: Path) -> int:
    """The KV pool config.pbtxt's defaults give this checkpoint, as vLLM sizes one without a
    GPU: every one of max_num_seqs sequences at full context length, within
    kv_cache_memory_gib (K and V, each layer, each KV head, head_dim floats per token)."""
    hf = json.loads((model_dir / "config.json").read_text())
    _, params = engine_pbtxt()
    per_seq = math.ceil(hf["max_position_embeddings"] / BLOCK_SIZE)
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    kv_bytes = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * FLOAT32_BYTES
    budget = float(params["kv_cache_memory_gib"]) * 2**30 // (kv_bytes * BLOCK_SIZE)
    return int(min(per_seq * int(params["max_num_seqs"]), budget))


def test_gateway_serves_what_the_endpoint_picker_reads(
    server: TritonServer, gateway: str, model_dir: Path
) -> None:
    triton = httpx.get(server.metrics_url, timeout=10).text
    relayed = httpx.get(f"{gateway}/metrics", timeout=10)
    assert relayed.status_code == 200, relayed.text
    assert relayed.headers["content-type"].startswith("text/plain")
    # the gauges, under the names the picker asks for, on Triton's port and the gateway's
    for name in EPP_GAUGES:
        assert name in GAUGES
        assert re.search(rf"^{name}\{{", triton, re.M), f"{name} not on Triton's port"
    via_gateway, direct = metrics(f"{gateway}/metrics"), metrics(server.metrics_url)
    assert set(via_gateway) == set(direct) and set(EPP_GAUGES) <= set(direct)
    # vllm:cache_config_info: one series, value 1, the KV pool's shape in vLLM's labels
    ((labels, value),) = CACHE_INFO.findall(triton)
    info = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    assert float(value) == 1
    assert {"block_size": info["block_size"], "num_gpu_blocks": info["num_gpu_blocks"]} == {
        "block_size": str(BLOCK_SIZE),
        "num_gpu_blocks": str(expected_blocks(model_dir)),
    }
    assert set(EPP_CACHE_LABELS) <= set(info) and info["model"] == "llm_engine"
    assert CACHE_INFO.findall(relayed.text) == [(labels, value)]
