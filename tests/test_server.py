"""The model repository on a real tritonserver (nvidia-pytriton wheel, CPU), queried with
real clients: HTTP generate / generate_stream and tritonclient gRPC streaming."""

from __future__ import annotations

import json
import queue
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.serving.launcher import make_server
from pagedllm.serving.tritonserver import TritonServer

PROMPT = "Once upon a time"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    with make_server(
        str(checkpoints["llama"]), dtype="float32", work_dir=tmp_path_factory.mktemp("triton")
    ) as s:
        yield s


@pytest.fixture(scope="module")
def offline(checkpoints: dict[str, Path]) -> str:
    llm = LLM(str(checkpoints["llama"]), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def body(**extra: Any) -> dict[str, Any]:
    return {
        "text_input": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "sampling_parameters": json.dumps({"ignore_eos": True}),
        **extra,
    }


def test_http_generate_matches_offline(server: TritonServer, offline: str) -> None:
    status, text = post(f"{server.http_url}/v2/models/llm_engine/generate", body())
    assert status == 200, text
    out = json.loads(text)
    assert out["text_output"] == PROMPT + offline  # the prompt first, as Triton's backends do
    assert out["finish_reason"] == "length" and out["num_output_tokens"] == MAX_TOKENS
    status, text = post(
        f"{server.http_url}/v2/models/llm_engine/generate", body(exclude_input_in_output=True)
    )
    assert json.loads(text)["text_output"] == offline


def test_http_generate_stream_concatenates_to_offline(server: TritonServer, offline: str) -> None:
    status, text = post(
        f"{server.http_url}/v2/models/llm_engine/generate_stream", body(stream=True)
    )
    assert status == 200
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    assert len(events) == MAX_TOKENS
    assert [e["index"] for e in events] == list(range(MAX_TOKENS))
    assert "".join(e["text_output"] for e in events) == offline
    assert events[-1]["finish_reason"] == "length"


def test_grpc_streaming_with_tritonclient(server: TritonServer, offline: str) -> None:
    import tritonclient.grpc as grpcclient

    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def tensor(name: str, value: Any, dtype: str) -> Any:
        arr = np.array([value], dtype=np.object_ if dtype == "BYTES" else None)
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr.astype(np.int32) if dtype == "INT32" else arr)
        return t

    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = [
        tensor("text_input", PROMPT.encode(), "BYTES"),
        tensor("max_tokens", MAX_TOKENS, "INT32"),
        tensor("stream", True, "BOOL"),
        tensor("sampling_parameters", b'{"temperature": 0, "ignore_eos": true}', "BYTES"),
    ]
    client.async_stream_infer("llm_engine", inputs, enable_empty_final_response=True)
    texts = []
    while True:
        result, error = results.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        if result.as_numpy("text_output") is not None:
            texts.append(result.as_numpy("text_output")[0].decode())
        if response.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    assert "".join(texts) == offline


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"sampling_parameters": "{not json"}, "not valid JSON"),
        ({"sampling_parameters": '{"max_tokenz": 3}'}, "unknown sampling parameters: max_tokenz"),
        ({"text_input": ""}, "prompt is empty"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": -1.0}, "temperature must be non-negative"),
        ({"max_tokens": 10**6}, "exceeds the model's context"),
    ],
)
def test_bad_requests_get_errors_and_the_server_keeps_serving(
    server: TritonServer, offline: str, bad: dict[str, Any], message: str
) -> None:
    status, text = post(f"{server.http_url}/v2/models/llm_engine/generate", {**body(), **bad})
    assert message in text, (status, text)
    status, text = post(
        f"{server.http_url}/v2/models/llm_engine/generate", body(exclude_input_in_output=True)
    )
    assert status == 200 and json.loads(text)["text_output"] == offline
