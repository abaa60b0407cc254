"""Fault isolation on a real tritonserver, through the `fault_injection` test hook of
`llm_engine` (off by default): a fault one request causes fails that request alone, every
other stream stays token-exact and the KV cache is empty afterwards; a fault that poisons
the engine fails what is in flight with a clear error, refuses what comes next, and stops
the server (it turns unready and exits) instead of leaving it stuck."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import server_metrics
from test_isolation import EngineStream
from test_server import GrpcStream, offline_text

from pagedllm import LLM
from pagedllm.serving.tritonserver import TritonServer

# beyond the tiny tokenizer's vocabulary (368): no text prompt ever holds it
FAULTY_TOKEN = 380


def start(ckpt: Path, work: Path, fault_injection: str) -> TritonServer:
    from pagedllm.serving.launcher import make_server

    env = {"PAGEDLLM_FAULT_INJECTION": fault_injection}
    server = make_server(str(ckpt), dtype="float32", work_dir=work, env=env)
    server.start()
    return server


def good(max_tokens: int) -> dict[str, Any]:
    return {
        "text_input": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


def test_a_request_that_faults_fails_alone(
    checkpoints: dict[str, Path], tmp_path: Path, llm: LLM
) -> None:
    server = start(checkpoints["llama"], tmp_path, f"fail_on_token={FAULTY_TOKEN}")
    try:
        streams = [GrpcStream(server, good(200)) for _ in range(4)]
        while not all(s.responses for s in streams):  # all in the running batch
            time.sleep(0.01)
        faulty = EngineStream(server, input_ids=[5, FAULTY_TOKEN, 6], text_input="")
        texts = [s.wait() for s in streams]
        faulty.close()
        assert len(faulty.errors) == 1, faulty.errors
        assert "request failed in the model runner" in faulty.errors[0]
        assert "Traceback" not in faulty.errors[0] and ".py" not in faulty.errors[0]
        expected = offline_text(llm, max_tokens=200)
        assert texts == [expected] * 4
        server_metrics.wait_idle(server.metrics_url, timeout=5)  # every KV block free
        assert server.is_ready()
    finally:
        server.stop()


def test_a_poisoned_engine_fails_clearly_and_stops_the_server(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    server = start(checkpoints["llama"], tmp_path, "poison_after_steps=20")
    try:
        stream = GrpcStream(server, good(100))
        assert stream.done.wait(60)
        stream.client.stop_stream()
        assert "the engine is dead" in str(stream.error)
        assert server.process is not None
        start_wait = time.monotonic()
        assert server.process.wait(60) is not None  # it stops instead of staying stuck
        print(f"server stopped {time.monotonic() - start_wait:.1f} s after the failure")
        assert not server.is_ready()
    finally:
        server.stop()
    assert "stopping tritonserver" in server.log_path.read_text()
