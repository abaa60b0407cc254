"""genai-perf against the real server, in both of its Triton formats (`--backend tensorrtllm`
and `--backend vllm`), streaming, with `--output-tokens-mean-deterministic`.

genai-perf writes the requests it will send (`inputs.json`), then runs NVIDIA's `perf_analyzer`
binary to send them; that binary is not on PyPI (the `perf-analyzer` package there is an empty
placeholder), so genai-perf stops at that point here. The test runs genai-perf's own command
line, takes the file it wrote, and sends every request the way perf_analyzer does with
`--input-data`: each key an input tensor, typed from the model's metadata, over one gRPC stream
— then checks that every answer has exactly the output length asked for."""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedllm.serving.tritonserver import TritonServer

SHARES_SERVER = True  # conftest's session server: requests only, metrics read as deltas
OUTPUT_TOKENS = 24
NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "FP32": np.float32}
NUMPY["UINT64"] = np.uint64


def genai_perf_inputs(backend: str, tokenizer: Path, url: str, work: Path) -> list[dict[str, Any]]:
    """Run genai-perf as a user does; return the requests it generated."""
    exe = Path(sys.executable).with_name("genai-perf")
    assert exe.exists() or shutil.which("genai-perf"), "genai-perf is not installed"
    command = [
        str(exe),
        "profile",
        "-m",
        "ensemble",
        "--endpoint-type",
        "kserve",
        "--backend",
        backend,
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--output-tokens-mean",
        str(OUTPUT_TOKENS),
        "--output-tokens-mean-deterministic",
        "--synthetic-input-tokens-mean",
        "32",
        "--synthetic-input-tokens-stddev",
        "0",
        "--num-prompts",
        "4",
        "--request-count",
        "4",
        "--url",
        url,
    ]
    run = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300)
    files = list(work.glob("artifacts/*/inputs.json"))
    assert len(files) == 1, run.stdout + run.stderr
    data: list[dict[str, Any]] = json.loads(files[0].read_text())["data"]
    return data


def send_like_perf_analyzer(server: TritonServer, requests: list[dict[str, Any]]) -> list[Any]:
    """Each request's streamed responses (perf_analyzer --streaming: gRPC stream)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    metadata = client.get_model_metadata("ensemble", as_json=True)
    datatypes = {i["name"]: i["datatype"] for i in metadata["inputs"]}
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    answers = []
    for request in requests:
        inputs = []
        for name, values in request.items():
            if name == "model":  # genai-perf's own key, not a tensor
                continue
            datatype = datatypes[name]  # an unknown name fails here, as in perf_analyzer
            if datatype == "BYTES":
                values = [v.encode() for v in values]
            array: np.ndarray = np.array(values, dtype=NUMPY[datatype])
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                responses.append(result)
            if response.parameters["triton_final_response"].bool_param:
                break
        answers.append(responses)
    client.stop_stream()
    return answers


@pytest.mark.parametrize("backend", ["tensorrtllm", "vllm"])
def test_genai_perf_requests_get_exactly_the_output_length(
    server: TritonServer, checkpoints: dict[str, Path], tmp_path: Path, backend: str
) -> None:
    requests = genai_perf_inputs(backend, checkpoints["llama"], server.grpc_url, tmp_path)
    assert len(requests) == 4
    if backend == "tensorrtllm":
        assert requests[0]["min_length"] == [OUTPUT_TOKENS]  # TensorRT-LLM's name
    else:
        assert json.loads(requests[0]["sampling_parameters"][0])["min_tokens"] == "24"
    for request, responses in zip(requests, send_like_perf_analyzer(server, requests), strict=True):
        tokens = [len(r.as_numpy("output_token_ids")) for r in responses]
        assert sum(tokens) == OUTPUT_TOKENS, (request, tokens)
        assert len(responses) == OUTPUT_TOKENS  # streamed: one response per token
        text = "".join(r.as_numpy("text_output")[0].decode() for r in responses)
        assert text and not text.startswith(request["text_input"][0])  # input excluded
