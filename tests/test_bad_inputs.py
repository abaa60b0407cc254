"""The bad-input matrix against a real tritonserver: every bad request over every protocol
that can carry it — HTTP generate and generate_stream (`ensemble`), KServe v2 infer over HTTP
and unary gRPC (`llm`), gRPC streaming (`ensemble`) — and direct calls to each internal model.
Each case asserts the status class Triton gives our code (docs/serving.md, Limits and errors),
a message naming the problem, and no traceback or file path in it. Afterwards the server is
the same process with the same stub processes, idle, and greedy requests sent between the
cases stay token-exact against the offline engine. (The gateway's matrix:
test_openai_errors.py.)"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import server_metrics
from test_server import GrpcStream, body, grpc_inputs, offline_text, post

from pagedllm import LLM
from pagedllm.serving.tritonserver import TritonServer

MAX_PROMPT_BYTES = 4096
PROTOCOLS = ("http generate", "http generate_stream", "http infer", "grpc infer", "grpc stream")

# (case, inputs of `ensemble` / `llm`, what the message must say)
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("no text_input", {"text_input": None, "max_tokens": 3}, "text_input is required"),
    ("empty prompt", {"text_input": ""}, "the prompt is empty"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens must be at least 1"),
    ("max_tokens negative", {"max_tokens": -5}, "max_tokens must be at least 1"),
    ("temperature negative", {"temperature": -1.0}, "temperature must be non-negative"),
    ("top_p over 1", {"top_p": 1.5}, "top_p"),
    ("top_k negative", {"top_k": -7}, "top_k"),
    ("bad JSON", {"sampling_parameters": "{max_tokens: 3"}, "not valid JSON"),
    ("JSON not an object", {"sampling_parameters": "[1, 2]"}, "must be a JSON object"),
    ("unknown key", {"sampling_parameters": '{"tempreture": 1}'}, "unknown sampling parameters"),
    ("deep JSON", {"sampling_parameters": "[" * 10_000}, "nested too deeply"),
    ("NaN temperature", {"sampling_parameters": '{"temperature": "NaN"}'}, "finite number"),
    ("n over 64", {"sampling_parameters": '{"n": 65}'}, "n must be at most 64"),
    ("too many logprobs", {"sampling_parameters": '{"logprobs": 100}'}, "logprobs must be at"),
    ("bad seed", {"sampling_parameters": '{"seed": "abc"}'}, "seed must be an integer"),
    ("bad bool", {"sampling_parameters": '{"ignore_eos": "maybe"}'}, "must be a boolean"),
    ("prompt over context", {"text_input": "the quick fox " * 250}, "the model's context"),
    ("max_tokens over context", {"max_tokens": 100_000}, "exceeds the model's context"),
    ("prompt over byte limit", {"text_input": "x" * 5000}, "the limit is 4096"),
]


@pytest.fixture(scope="module")
def guarded(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """The tiny llama checkpoint (float32) with a small prompt byte limit."""
    from pagedllm.serving.launcher import make_server

    env = {"PAGEDLLM_MAX_PROMPT_BYTES": str(MAX_PROMPT_BYTES)}
    with make_server(
        str(checkpoints["llama"]), dtype="float32", work_dir=tmp_path_factory.mktemp("t"), env=env
    ) as server:
        yield server


def kserve_tensor(name: str, value: Any) -> dict[str, Any]:
    datatype = {str: "BYTES", bool: "BOOL", int: "INT32", float: "FP32"}[type(value)]
    return {"name": name, "shape": [1], "datatype": datatype, "data": [value]}


def send(server: TritonServer, protocol: str, inputs: dict[str, Any]) -> tuple[str, str]:
    """(what the status was, the error message) of one bad request."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inputs = {"text_input": "Once upon a time", **inputs}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    if protocol.startswith("http generate"):
        endpoint = protocol.split()[1]
        stream = endpoint == "generate_stream"
        status, text = post(
            f"{server.http_url}/v2/models/ensemble/{endpoint}", {**inputs, "stream": stream}
        )
        if stream and text.startswith("data:"):
            text = text[5:]
        return str(status), json.loads(text)["error"]
    if protocol == "http infer":
        tensors = [kserve_tensor(k, v) for k, v in inputs.items()]
        status, text = post(f"{server.http_url}/v2/models/llm/infer", {"inputs": tensors})
        return str(status), json.loads(text)["error"]
    if protocol == "grpc infer":
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            client.infer("llm", grpc_inputs(inputs))
        except InferenceServerException as e:
            return str(e.status()), str(e.message())
        return "OK", ""
    stream = GrpcStream(server, {**inputs, "stream": True})
    assert stream.done.wait(60), "no answer"
    stream.client.stop_stream()
    return "stream error", "" if stream.error is None else str(stream.error.message())


EXPECTED_STATUS = {
    "http generate": "400",
    "http generate_stream": "400",
    "http infer": "400",
    "grpc infer": "StatusCode.INVALID_ARGUMENT",
    "grpc stream": "stream error",
}


def no_internals(message: str) -> bool:
    return not any(s in message for s in ("Traceback", 'File "', ".py", "/work", "site-packages"))


def stub_pids(server: TritonServer) -> set[int]:
    """The server's child processes (the Python-backend stubs)."""
    assert server.process is not None
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == server.process.pid:
                children.add(int(entry))
    return children


@pytest.fixture(scope="module")
def exact(llm: LLM) -> str:
    return offline_text(llm)


def assert_good_request_exact(server: TritonServer, expected: str) -> None:
    status, text = post(
        f"{server.http_url}/v2/models/ensemble/generate", body(exclude_input_in_output=True)
    )
    assert status == 200 and json.loads(text)["text_output"] == expected, text


@pytest.fixture(scope="module")
def before(guarded: TritonServer) -> tuple[int, set[int]]:
    assert guarded.process is not None
    return guarded.process.pid, stub_pids(guarded)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("case", "inputs", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_request(
    guarded: TritonServer,
    before: tuple[int, set[int]],
    exact: str,
    protocol: str,
    case: str,
    inputs: dict[str, Any],
    message: str,
) -> None:
    status, error = send(guarded, protocol, inputs)
    assert status == EXPECTED_STATUS[protocol], error
    assert message in error
    assert no_internals(error), error
    if protocol == PROTOCOLS[-1]:  # a good request between the cases: still token-exact
        assert_good_request_exact(guarded, exact)


# direct calls to the internal models: (case, model, protocol, inputs, status, message)
def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def detokenizer_inputs(**overrides: Any) -> dict[str, Any]:
    meta = ids(0, 1, 1, 3, 1, 0, -1, -1, 0, 0, -1)
    strings = np.array([b"", b"length", b"k"], dtype=np.object_)
    values = {
        "ids": ids(5),
        "meta": meta,
        "strings": strings,
        "output_log_probs": np.zeros(0, dtype=np.float32),
        "output_token_ids": ids(5),
    }
    return {**values, **overrides}


DIRECT: list[tuple[str, str, dict[str, Any], str]] = [
    ("tokenizer without text", "tokenizer", {}, "text_input is required"),
    (
        "tokenizer over limit",
        "tokenizer",
        {"text_input": np.array([b"x" * 5000], dtype=np.object_)},
        "the limit is 4096",
    ),
    (
        "tokenizer non-UTF-8",
        "tokenizer",
        {"text_input": np.array([b"\xff\xfe"], dtype=np.object_)},
        "not valid UTF-8",
    ),
    (
        "detokenizer negative id",
        "detokenizer",
        detokenizer_inputs(ids=ids(-5)),
        "ids must be token ids",
    ),
    (
        "detokenizer huge window",
        "detokenizer",
        detokenizer_inputs(meta=ids(100, 1, 1, 3, 1, 0, -1, -1, 0, 0, -1)),
        "window_len",
    ),
    (
        "detokenizer bad strings",
        "detokenizer",
        detokenizer_inputs(strings=np.array([b"\xff", b"", b""], dtype=np.object_)),
        "valid UTF-8",
    ),
    (
        "detokenizer 2 strings",
        "detokenizer",
        detokenizer_inputs(strings=np.array([b"", b""], dtype=np.object_)),
        "strings must hold 3, 5, 7, ... BYTES values",  # dims [-1]: checked by the model
    ),
    (
        "detokenizer float log-probs",
        "detokenizer",
        detokenizer_inputs(output_log_probs=np.zeros(1, dtype=np.int32)),
        "data-type",
    ),
    (
        "engine ids past vocab",
        "llm_engine",
        {"input_ids": ids(10**6), "text_input": np.array([b""], dtype=np.object_)},
        "prompt token ids must be in",
    ),
    (
        "engine max_tokens 0",
        "llm_engine",
        {
            "input_ids": ids(5),
            "text_input": np.array([b""], dtype=np.object_),
            "max_tokens": ids(0),
        },
        "max_tokens must be at least 1",
    ),
    (
        "engine non-UTF-8 prompt",
        "llm_engine",
        {"text_input": np.array([b"\xff"], dtype=np.object_)},
        "not valid UTF-8",
    ),
    (
        "engine bad abort id",
        "llm_engine",
        {"abort_request_id": np.array([b"\xff" * 3], dtype=np.object_)},
        "",
    ),
]


def grpc_tensors(values: dict[str, Any]) -> list[Any]:
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, array in values.items():
        dtype = (
            "BYTES"
            if array.dtype == np.object_
            else {np.int32: "INT32", np.float32: "FP32"}[array.dtype.type]
        )
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


@pytest.mark.parametrize(("case", "model", "values", "message"), DIRECT, ids=[c[0] for c in DIRECT])
def test_direct_call_to_an_internal_model(
    guarded: TritonServer,
    before: tuple[int, set[int]],
    case: str,
    model: str,
    values: dict[str, Any],
    message: str,
) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(guarded.grpc_url)
    if model == "tokenizer":  # not decoupled: unary
        with pytest.raises(InferenceServerException) as error:
            client.infer(model, grpc_tensors(values))
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
        text = str(error.value.message())
    else:  # decoupled: a stream
        results: list[tuple[Any, Any]] = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        client.async_stream_infer(model, grpc_tensors(values), enable_empty_final_response=True)
        client.stop_stream()
        errors = [str(e.message()) for _, e in results if e is not None]
        if not message:  # harmless: one empty final response
            assert errors == [] and len(results) == 1
            return
        assert len(errors) == 1, results
        text = errors[0]
    assert message in text
    assert no_internals(text), text


def test_the_detokenizer_cannot_be_reached_by_unary_infer(guarded: TritonServer) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(guarded.grpc_url)
    with pytest.raises(InferenceServerException, match="decoupled"):
        client.infer("detokenizer", grpc_tensors(detokenizer_inputs()))


def test_after_the_matrix_the_server_is_whole_and_exact(
    guarded: TritonServer, before: tuple[int, set[int]], exact: str
) -> None:
    pid, stubs = before
    assert guarded.process is not None and guarded.process.pid == pid
    assert guarded.process.poll() is None and guarded.is_ready()
    assert stub_pids(guarded) == stubs  # no stub crashed or was restarted
    server_metrics.wait_idle(guarded.metrics_url, timeout=10)  # nothing left running or held
    assert_good_request_exact(guarded, exact)
