"""LoRA served by a real tritonserver (one server, two PEFT adapters; lora_server_fixtures.py),
the way vllm_backend and TensorRT-LLM users call it: `lora_name` in `sampling_parameters` or
in the request's parameters routes a request to its adapter, each text equal to the offline
engine's with that adapter; an unknown name is vllm_backend's error, and the server stays
healthy; unknown request parameters are refused; TensorRT-LLM's `lora_task_id` with its
weights and config rows. The OpenAI gateway in front of it: test_lora_gateway.py."""

from __future__ import annotations

import argparse
import json
import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lora_adapters import fp16_copy, save_adapter, trtllm_rows
from lora_server_fixtures import NAMES
from lora_serving import MAX_TOKENS
from test_server import PROMPT, body, post
from tritonclient.utils import np_to_triton_dtype

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.serving.lora import add_serve_arguments, lora_modules, serve_env
from pagedllm.serving.tritonserver import TritonServer


@pytest.fixture(scope="module")
def server(lora_server: TritonServer) -> TritonServer:
    """The session's LoRA server (lora_server_fixtures.py), not conftest's plain one."""
    return lora_server


def generate(server: TritonServer, **extra: object) -> tuple[int, dict]:
    status, text = post(
        f"{server.http_url}/v2/models/ensemble/generate",
        body(max_tokens=MAX_TOKENS, exclude_input_in_output=True, **extra),
    )
    return status, json.loads(text)


def result(out: dict) -> tuple:
    ids = out["output_token_ids"]
    return out["text_output"], ids if isinstance(ids, list) else [ids]


def test_lora_name_routes_each_request_to_its_adapter(
    server: TritonServer, offline: dict[str | None, tuple]
) -> None:
    for name in NAMES:  # vllm_backend's two places: sampling_parameters, request parameters
        sampling = json.dumps({"ignore_eos": True, "lora_name": name})
        status, out = generate(server, sampling_parameters=sampling)
        assert status == 200, out
        assert result(out) == offline[name]
        status, out = generate(server, parameters={"lora_name": name})
        assert status == 200, out
        assert result(out) == offline[name]
    status, out = generate(server)
    assert (status, result(out)) == (200, offline[None])


def test_unknown_adapter_is_vllm_backends_error_and_the_server_stays_healthy(
    server: TritonServer, offline: dict[str | None, tuple]
) -> None:
    status, out = generate(server, parameters={"lora_name": "nope"})
    assert status == 400
    # (the ensemble puts its name ahead of the step's message)
    assert out["error"].endswith(
        "LoRA nope is not supported, we currently support ['all', 'mlp_o']"
    )
    sampling = json.dumps({"ignore_eos": True, "lora_name": "nope"})
    status, out = generate(server, sampling_parameters=sampling)
    assert status == 400 and "LoRA nope is not supported" in out["error"]
    status, out = generate(server, parameters={"lora_name": "all"})
    assert (status, result(out)) == (200, offline["all"])


def test_lora_switched_off_is_vllm_backends_error(shared_server: TritonServer) -> None:
    """The session's shared server (no --enable-lora): a lora_name is refused, not ignored."""
    status, out = generate(shared_server, parameters={"lora_name": "all"})
    assert status == 400 and out["error"].endswith("LoRA feature is not enabled."), out


def test_adapters_from_multi_lora_json_and_serve_flags(tmp_path: Path) -> None:
    """vllm_backend's multi_lora.json (paths relative to it), the lora_modules setting over
    it; `pagedllm serve`'s flags as the settings they stand for."""
    (tmp_path / "multi_lora.json").write_text(json.dumps({"a": "ad/a", "b": "/abs/b"}))
    modules = lora_modules({"lora_modules": json.dumps({"b": "/other/b"})}, str(tmp_path))
    assert modules == {"a": str(tmp_path / "ad" / "a"), "b": "/other/b"}
    with pytest.raises(ValueError, match="lora_modules must be a JSON object"):
        lora_modules({"lora_modules": "[1]"})
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "x=/p/x", "--max-loras", "3"])
    assert serve_env(args) == {
        "PAGEDLLM_ENABLE_LORA": "true",
        "PAGEDLLM_LORA_MODULES": json.dumps({"x": "/p/x"}),
        "PAGEDLLM_MAX_LORAS": "3",
    }
    with pytest.raises(ValueError, match="need --enable-lora"):
        serve_env(parser.parse_args(["--lora-modules", "x=/p/x"]))
    with pytest.raises(ValueError, match="NAME=PATH"):
        serve_env(parser.parse_args(["--enable-lora", "--lora-modules", "x"]))


# --- request parameters (request_params.py) -------------------------------------------------


def test_request_parameters_as_vllm_backend_reads_them(
    server: TritonServer, offline: dict[str | None, tuple]
) -> None:
    """vllm_backend's README form: sampling parameters, lora_name and exclude_input_in_output
    as request parameters (the ensemble and the unary `llm` alike); an unknown one, or a
    misspelled input of a generate body (Triton makes it a parameter), is a 400 naming it."""
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    for model in ("ensemble", "llm"):
        url = f"{server.http_url}/v2/models/{model}/generate"
        request = {"text_input": PROMPT, "parameters": {**params, "lora_name": "mlp_o"}}
        request["parameters"]["exclude_input_in_output"] = True
        status, text = post(url, request)
        assert status == 200, text
        assert result(json.loads(text))[0] == offline["mlp_o"][0]
        status, text = post(url, {"text_input": PROMPT, "parameters": {"lora_nmae": "all"}})
        assert status == 400 and "unknown request parameter 'lora_nmae'; the accepted" in text
        assert "lora_name" in text
        status, text = post(url, {"text_input": PROMPT, "max_tokns": 4})
        assert status == 400 and "unknown request parameter 'max_tokns'" in text, text
    import tritonclient.grpc as grpcclient
    from test_trtllm_bls import prepare_inputs

    errors: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: errors.put(error))
    inputs = []
    for name, value in prepare_inputs(PROMPT, 4, False).items():
        inputs.append(grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    client.async_stream_infer("tensorrt_llm_bls", inputs, parameters={"x": 1})
    client.stop_stream()
    assert "'x': tensorrt_llm_bls takes no request parameters" in str(errors.get(timeout=60))


# --- TensorRT-LLM's lora_task_id (lora_tasks.py) ---------------------------------------------

TASK = 77


@pytest.fixture(scope="module")
def task_adapter(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 adapter on all seven projections whose fp16 rows are exact (`fp16_copy`)."""
    root = tmp_path_factory.mktemp("lora-task")
    peft = save_adapter(checkpoints["llama"], root / "peft", "all", seed=31)
    return fp16_copy(peft, root / "fp16")


def test_lora_task_id_as_tensorrt_llm_serves_it(
    server: TritonServer, task_adapter: Path, checkpoints: dict[str, Path]
) -> None:
    """The first request of a task id carries TensorRT-LLM's rows of a PEFT adapter
    (tensorrt_llm_bls, its own client's shapes); later ones the id alone (here through the
    ensemble): each the offline engine's text with that PEFT adapter; an id never sent is
    TensorRT-LLM's error, and the server answers on."""
    from test_trtllm_bls import prepare_inputs, run_inference, texts

    llm = LLM(str(checkpoints["llama"]), dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    lora = LoRARequest("t", 1, str(task_adapter))
    [out, base] = llm.generate([PROMPT] * 2, params, lora_request=[lora, None], use_tqdm=False)
    expected = out.outputs[0].text
    assert expected != base.outputs[0].text
    weights, config = trtllm_rows(task_adapter)
    first = prepare_inputs(
        PROMPT,
        MAX_TOKENS,
        False,
        lora_task_id=np.array([[TASK]], dtype=np.uint64),
        lora_weights=weights[None],  # [1, N, W], as the client np.load()s it
        lora_config=config[None],
    )
    assert texts(run_inference(server, first)) == [PROMPT + expected]
    url = f"{server.http_url}/v2/models/ensemble/generate"
    request = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    request["exclude_input_in_output"] = True
    status, text = post(url, {**request, "lora_task_id": TASK})
    assert status == 200 and json.loads(text)["text_output"] == expected, text
    status, text = post(url, {**request, "lora_task_id": TASK + 1})
    assert status == 400, text
    assert json.loads(text)["error"].endswith(
        f"LoRA task {TASK + 1} not found in cache. Please send LoRA weights with request"
    )
    status, text = post(url, request)
    assert (status, json.loads(text)["text_output"]) == (200, base.outputs[0].text)
