"""No client can disturb another, and a client that leaves costs nothing more: against a real
tritonserver with a slow tiny model (long generations), so that every request is still running
when the next step of the test happens.

- engine request ids are unguessable keys: guessed aborts sent straight to `llm_engine` leave a
  victim's stream untouched;
- a request whose client leaves — non-streamed ones too (gRPC stream, gRPC unary with a
  deadline) — is aborted and its KV blocks freed within about a second (the engine's probes);
- admission control: past max_num_seqs + max_queued_requests, requests are refused at once
  with UNAVAILABLE / HTTP 503 and counted;
- prompts over max_prompt_bytes are refused before they are tokenized.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import server_metrics
from test_server import GrpcStream, grpc_inputs, post

from pagedllm.serving.tritonserver import TritonServer

LONG = 2000  # tokens: tens of seconds on this model, far longer than any wait below
MAX_NUM_SEQS, MAX_QUEUED = 4, 2
MAX_PROMPT_BYTES = 4096
ABORTED = "vllm:request_success_total{finished_reason=abort}"


@pytest.fixture(scope="module")
def slow_server(
    slow_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    from pagedllm.serving.launcher import make_server

    ckpt = slow_checkpoint
    env = {
        "PAGEDLLM_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
        "PAGEDLLM_MAX_QUEUED_REQUESTS": str(MAX_QUEUED),
        "PAGEDLLM_MAX_PROMPT_BYTES": str(MAX_PROMPT_BYTES),
    }
    with make_server(
        str(ckpt), dtype="float32", work_dir=tmp_path_factory.mktemp("triton"), env=env
    ) as server:
        yield server


def long_request(**extra: Any) -> dict[str, Any]:
    return {"text_input": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, **extra}


def aborted(server: TritonServer) -> float:
    return server_metrics.metrics(server.metrics_url).get(ABORTED, 0.0)


def wait_running(server: TritonServer, n: int, timeout: float = 60) -> None:
    server_metrics.wait_running(server.metrics_url, n, timeout)


def idle_within(server: TritonServer, seconds: float) -> float:
    """Seconds until nothing runs and no KV block is held (asserting it is under `seconds`)."""
    took = server_metrics.wait_idle(server.metrics_url, timeout=seconds)
    assert took < seconds, f"still busy after {seconds} s"
    return took


def http_then_hang_up(server: TritonServer, path: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
        sock.sendall(head.encode() + data)
        wait_running(server, 1)
    # the connection is closed: the client has gone


class EngineStream:
    """A direct client of `llm_engine` (its window protocol): every response's `meta` and
    `strings`, or the error."""

    def __init__(self, server: TritonServer, **values: Any) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: list[tuple[list[int], list[str]]] = []
        self.errors: list[str] = []
        self.client.start_stream(callback=self._on_response)
        if values:
            self.send(**values)

    def send(self, **values: Any) -> None:
        self.client.async_stream_infer("llm_engine", engine_inputs(**values))

    def _on_response(self, result: Any, error: Any) -> None:
        if error is not None:
            self.errors.append(str(error))
        elif result.as_numpy("meta") is not None:
            meta = [int(v) for v in result.as_numpy("meta")]
            strings = [s.decode() for s in result.as_numpy("strings")]
            self.results.append((meta, strings))

    def close(self) -> None:
        self.client.stop_stream()


def engine_inputs(input_ids: list[int] | None = None, **values: Any) -> list[Any]:
    import tritonclient.grpc as grpcclient

    inputs = grpc_inputs(values)
    if input_ids is not None:
        ids = grpcclient.InferInput("input_ids", [len(input_ids)], "INT32")
        ids.set_data_from_numpy(np.array(input_ids, dtype=np.int32))
        inputs.append(ids)
    return inputs


def test_guessed_aborts_sent_to_llm_engine_do_not_touch_other_clients(
    slow_server: TritonServer,
) -> None:
    victim = GrpcStream(slow_server, {**long_request(max_tokens=200), "stream": True})
    wait_running(slow_server, 1)
    # what an attacker can try: the old counter ids and other easy guesses
    attacker = EngineStream(slow_server)
    for guess in [f"triton-{i}" for i in range(300)] + ["", "0", "*", "triton-*"]:
        attacker.send(abort_request_id=guess)
    attacker.close()
    assert attacker.errors == []  # each answered with an empty final response, nothing else
    victim.wait(timeout=180)
    assert victim.responses[-1][1]["finish_reason"] == "length"
    assert victim.responses[-1][1]["num_output_tokens"] == 200


def test_engine_ids_are_random_keys_that_abort_only_their_own_request(
    slow_server: TritonServer,
) -> None:
    short = EngineStream(slow_server)
    for _ in range(3):
        short.send(input_ids=[5, 6, 7], text_input="", max_tokens=1)
    short.close()
    keys = {strings[2] for _, strings in short.results}
    assert len(keys) == 3
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)  # 128 random bits, in hex
    # the owner of a key (the pipeline, or a direct client for its own request) aborts with it
    before = aborted(slow_server)
    own = EngineStream(slow_server, input_ids=[5, 6, 7], **long_request(text_input=""))
    wait_running(slow_server, 1)
    while not own.results:  # a probe (meta.probe = 1) comes within 0.5 s
        time.sleep(0.05)
    meta, strings = own.results[0]
    assert meta[8] == 1 and strings[:2] == ["", ""]  # a probe (META "probe"): nothing to show
    EngineStream(slow_server, abort_request_id=strings[2]).close()
    idle_within(slow_server, 5)
    assert aborted(slow_server) == before + 1
    own.close()
    assert own.results[-1][1][1] == "abort"


# NOTE: not HTTP generate / KServe HTTP infer: Triton 2.51's HTTP frontend notices a closed
# connection only when it writes to it, and a non-streamed request writes nothing before its
# end (docs/serving.md, Limits and errors); a streamed one is covered here
@pytest.mark.parametrize("protocol", ["grpc stream", "grpc unary deadline", "http stream"])
def test_a_request_whose_client_left_is_aborted(slow_server: TritonServer, protocol: str) -> None:
    import tritonclient.grpc as grpcclient

    before = aborted(slow_server)
    if protocol == "http stream":
        body = long_request(stream=True)
        http_then_hang_up(slow_server, "/v2/models/ensemble/generate_stream", body)
    elif protocol == "grpc stream":
        stream = GrpcStream(slow_server, {**long_request(), "stream": False})
        wait_running(slow_server, 1)
        stream.cancel()
    else:
        client = grpcclient.InferenceServerClient(slow_server.grpc_url)
        with pytest.raises(Exception, match="Deadline"):
            client.infer("llm", grpc_inputs(long_request()), client_timeout=1.0)
    # the engine's probe (every 0.5 s) meets the cancelled request: abort, blocks freed
    idle_within(slow_server, 3)
    assert aborted(slow_server) == before + 1


def test_admission_control_refuses_at_once_past_the_queue_limit(
    slow_server: TritonServer,
) -> None:
    before = server_metrics.metrics(slow_server.metrics_url)
    accepted = [
        GrpcStream(slow_server, {**long_request(), "stream": True})
        for _ in range(MAX_NUM_SEQS + MAX_QUEUED)
    ]
    wait_running(slow_server, MAX_NUM_SEQS)
    deadline = time.monotonic() + 60  # and the last two queued (they may arrive later)
    while (
        server_metrics.metrics(slow_server.metrics_url).get("vllm:num_requests_waiting")
        != MAX_QUEUED
    ):
        assert time.monotonic() < deadline, "the queue never filled"
        time.sleep(0.02)
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    start = time.monotonic()
    # UNAVAILABLE: HTTP 503 on KServe infer, gRPC UNAVAILABLE; Triton's generate endpoint
    # answers every model error with 400 (upstream), our message says why
    status, text = post(f"{slow_server.http_url}/v2/models/llm/infer", infer_body("hi"))
    assert status == 503, text
    client = grpcclient.InferenceServerClient(slow_server.grpc_url)
    with pytest.raises(InferenceServerException) as refusal:
        client.infer("llm", grpc_inputs({"text_input": "hi"}))
    assert refusal.value.status() == "StatusCode.UNAVAILABLE"
    status, text = post(f"{slow_server.http_url}/v2/models/ensemble/generate", long_request())
    assert status == 400 and "server busy" in json.loads(text)["error"], text
    refused = GrpcStream(slow_server, {**long_request(), "stream": True})
    assert refused.done.wait(10)
    assert "server busy" in str(refused.error)
    refused.client.stop_stream()  # an open stream holds a stopping server for 30 s
    assert time.monotonic() - start < 10  # at once, not after the others
    for stream in accepted:
        stream.cancel()
    idle_within(slow_server, 5)
    after = server_metrics.metrics(slow_server.metrics_url)
    name = "pagedllm:requests_rejected_total{reason=queue_full}"
    assert after[name] - before.get(name, 0) == 4


def infer_body(text: str) -> dict[str, Any]:
    return {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [text]}]}


def test_prompts_over_the_byte_limit_are_refused_before_tokenizing(
    slow_server: TritonServer,
) -> None:
    huge = "word " * (MAX_PROMPT_BYTES // 5 + 1)
    for path in ("ensemble/generate", "llm/infer"):
        if path == "llm/infer":
            body: dict[str, Any] = {
                "inputs": [
                    {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [huge]}
                ]
            }
        else:
            body = {"text_input": huge, "max_tokens": 1}
        status, text = post(f"{slow_server.http_url}/v2/models/{path}", body)
        assert status == 400, text
        assert f"the limit is {MAX_PROMPT_BYTES} (max_prompt_bytes)" in text
