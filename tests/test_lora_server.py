"""LoRA served by a real tritonserver (one server, two PEFT adapters), the way vllm_backend
users call it: `lora_name` in `sampling_parameters` or in the request's parameters routes a
request to its adapter, each text equal to the offline engine's with that adapter; an
unknown name is vllm_backend's error, and the server stays healthy. The same server behind
the OpenAI gateway, as vLLM's users call it: adapters by model name, `/v1/models`, runtime
loading and unloading, and vLLM's LoRA gauge."""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
import openai
import pytest
import torch
import tritonclient.grpc.aio as grpcclient
from lora_adapters import save_adapter
from lora_serving import GREEDY, MAX_TOKENS, complete, lora_series, not_found, write_adapter
from openai_gateway import CHAT_TEMPLATE, running_gateway
from test_server import PROMPT, body, post
from tritonclient.utils import np_to_triton_dtype

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.request import RUNTIME_LORA_ENV
from pagedllm.serving.launcher import make_server
from pagedllm.serving.lora import add_serve_arguments, lora_modules, serve_env
from pagedllm.serving.tritonserver import TritonServer

NAMES = ("all", "mlp_o")  # two of lora_adapters.ADAPTERS: different ranks and targets
RUNTIME = "qv"  # a third, loaded while the server runs


@pytest.fixture(scope="module")
def adapters(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora-server")
    base = checkpoints["llama"]
    return {n: str(save_adapter(base, root / n, n, seed=20)) for n in (*NAMES, RUNTIME)}


@pytest.fixture(scope="module")
def server(
    checkpoints: dict[str, Path], adapters: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    env = {
        "PAGEDLLM_ENABLE_LORA": "true",
        "PAGEDLLM_MAX_LORAS": "2",
        "PAGEDLLM_MAX_LORA_RANK": "8",
        "PAGEDLLM_LORA_MODULES": json.dumps({n: adapters[n] for n in NAMES}),
        RUNTIME_LORA_ENV: "true",  # the engine obeys the gateway's load and unload
    }
    work = tmp_path_factory.mktemp("triton-lora")
    with make_server(str(checkpoints["llama"]), dtype="float32", work_dir=work, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def lora_llm(checkpoints: dict[str, Path]) -> LLM:
    """The offline engine with LoRA on: the oracle."""
    return LLM(str(checkpoints["llama"]), dtype="float32", enable_lora=True, max_loras=2)


def offline_outputs(
    llm: LLM, adapters: dict, prompt: str, names: tuple[str | None, ...]
) -> dict[str | None, tuple]:
    """Each adapter's (text, token ids) for `prompt`, the base model's under None."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [n and LoRARequest(n, (*NAMES, RUNTIME).index(n) + 1, adapters[n]) for n in names]
    outs = llm.generate([prompt] * len(loras), params, lora_request=loras, use_tqdm=False)
    return {
        name: (o.outputs[0].text, list(o.outputs[0].token_ids))
        for name, o in zip(names, outs, strict=True)
    }


@pytest.fixture(scope="module")
def offline(lora_llm: LLM, adapters: dict) -> dict[str | None, tuple]:
    """Each adapter's (text, token ids), and the base model's under None, from the offline
    engine."""
    texts = offline_outputs(lora_llm, adapters, PROMPT, (None, *NAMES, RUNTIME))
    assert len({tuple(ids) for _, ids in texts.values()}) == 4  # each adapter changes them
    return texts


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


# --- the OpenAI gateway (vLLM's LoRA interface) -----------------------------------------------


@pytest.fixture(scope="module")
def gateway(
    server: TritonServer, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`pagedllm openai` in front of the LoRA server, runtime loading allowed (vLLM's env)."""
    work = tmp_path_factory.mktemp("lora-gateway")
    template = work / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = ("--chat-template", str(template))
    env = {RUNTIME_LORA_ENV: "true"}
    with running_gateway(server, checkpoints["llama"], work / "log", *args, env=env) as url:
        yield url


@pytest.fixture(scope="module")
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0)


BASE = "llama"  # the gateway's name for the base model: its folder's


def test_gateway_model_names_are_adapters(
    client: openai.OpenAI, gateway: str, offline: dict[str | None, tuple]
) -> None:
    for name in (None, *NAMES):
        assert complete(client, name or BASE) == offline[name][0]
    r = httpx.post(f"{gateway}/v1/completions", json={"model": "nope", "prompt": PROMPT})
    not_found(r, "nope")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=RUNTIME, prompt=PROMPT)  # not loaded yet
    beams = {"model": "all", "prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 4}
    r = httpx.post(f"{gateway}/v1/completions", json=beams)  # never the base model's beams
    assert r.status_code == 400 and "beam search with a LoRA adapter" in r.text, r.text
    assert complete(client, "all") == offline["all"][0]  # the server is fine


def test_gateway_chat_on_an_adapter(client: openai.OpenAI, lora_llm: LLM, adapters: dict) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    rendered = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    expected = offline_outputs(lora_llm, adapters, rendered, ("mlp_o", None))
    assert expected["mlp_o"] != expected[None]
    for name in ("mlp_o", None):
        out = client.chat.completions.create(model=name or BASE, messages=messages, **GREEDY)  # type: ignore[arg-type]
        assert (out.model, out.choices[0].message.content) == (name or BASE, expected[name][0])


def test_v1_models_lists_the_adapters_under_the_base(
    gateway: str, checkpoints: dict[str, Path], adapters: dict
) -> None:
    cards = httpx.get(f"{gateway}/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (BASE, None, str(checkpoints["llama"])),
        *((n, BASE, adapters[n]) for n in NAMES),
    ]
    card = httpx.get(f"{gateway}/v1/models/mlp_o").json()
    assert (card["id"], card["parent"], card["object"]) == ("mlp_o", BASE, "model")
    not_found(httpx.get(f"{gateway}/v1/models/nope"), "nope")


def test_load_use_unload_through_the_gateway(
    client: openai.OpenAI,
    gateway: str,
    adapters: dict,
    offline: dict[str | None, tuple],
    checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    http = httpx.Client(base_url=gateway, timeout=60)
    load = {"lora_name": RUNTIME, "lora_path": adapters[RUNTIME]}
    r = http.post("/v1/load_lora_adapter", json=load)
    assert (r.status_code, r.text) == (
        200,
        f"Success: LoRA adapter '{RUNTIME}' added successfully.",
    )
    assert complete(client, RUNTIME) == offline[RUNTIME][0]
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert (cards[RUNTIME]["parent"], cards[RUNTIME]["root"]) == (BASE, adapters[RUNTIME])

    def refused(path: str, body: dict, status: int, message: str) -> None:
        r = http.post(path, json=body)
        assert r.status_code == status and message in r.json()["error"]["message"], r.text

    refused("/v1/load_lora_adapter", load, 400, f"The lora adapter '{RUNTIME}' has already been")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": RUNTIME})
    assert (r.status_code, r.text) == (
        200,
        f"Success: LoRA adapter '{RUNTIME}' removed successfully.",
    )
    not_found(http.post("/v1/completions", json={"model": RUNTIME, "prompt": PROMPT}), RUNTIME)
    refused("/v1/unload_lora_adapter", {"lora_name": RUNTIME}, 404, "cannot be found")
    assert RUNTIME not in {c["id"] for c in http.get("/v1/models").json()["data"]}

    # refusals, each naming what is wrong
    refused("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path'")
    missing = {"lora_name": "x", "lora_path": str(tmp_path / "none")}
    refused("/v1/load_lora_adapter", missing, 404, "No adapter found for")
    config = {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}
    hidden = json.loads((checkpoints["llama"] / "config.json").read_text())["hidden_size"]
    weights = {  # rank 16, above the server's max_lora_rank of 8
        f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": torch.ones(shape)
        for ab, shape in (("A", (16, hidden)), ("B", (hidden, 16)))
    }
    bad = {
        "rank 16, above max_lora_rank 8": write_adapter(tmp_path / "r16", config, weights),
        "'c_attn', which the model lacks": write_adapter(
            tmp_path / "gpt2", {**config, "target_modules": ["c_attn"]}
        ),
        "no adapter_model.safetensors": write_adapter(tmp_path / "nofile", config),
    }
    for message, path in bad.items():
        refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path}, 400, message)
    assert complete(client, BASE) == offline[None][0]  # the server is fine


def test_runtime_loading_is_opt_in(
    server: TritonServer, shared_server: TritonServer, checkpoints: dict[str, Path], adapters: dict
) -> None:
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the gateway has no such routes (vLLM's 404),
    and an engine whose process lacks it refuses a load sent to Triton directly."""
    from starlette.testclient import TestClient

    from pagedllm.openai.app import GatewayConfig, create_app
    from pagedllm.openai.lora_admin import ask_engine

    config = GatewayConfig(
        server.grpc_url, str(checkpoints["llama"]), allow_runtime_lora_updating=False
    )
    with TestClient(create_app(config)) as http:
        load = {"lora_name": RUNTIME, "lora_path": adapters[RUNTIME]}
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 404
        assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [BASE, *NAMES]

    async def ask(request: dict) -> object:
        client = grpcclient.InferenceServerClient(shared_server.grpc_url)
        try:
            return await ask_engine(client, request)
        finally:
            await client.close()

    answer = asyncio.run(ask({"action": "load", "lora_name": "a", "lora_path": adapters["all"]}))
    assert answer == {
        "error": f"runtime LoRA updating is off on this server ({RUNTIME_LORA_ENV})",
        "status": 400,
    }
    assert asyncio.run(ask({"action": "list"})) == {"adapters": []}


# --- vLLM's LoRA gauge ------------------------------------------------------------------------


def test_lora_gauge_names_the_running_adapters(server: TritonServer, client: openai.OpenAI) -> None:
    start = time.time()
    complete(client, "mlp_o")
    deadline = time.monotonic() + 10
    while True:  # the metrics reach Triton on a thread of their own
        series = lora_series(server.metrics_url)
        ran = [t for (m, running, _), t in series.items() if (m, running) == ("2", "mlp_o")]
        latest = max(series, key=series.__getitem__) if series else None
        if ran and max(ran) >= start - 1 and latest == ("2", "", ""):
            break
        assert time.monotonic() < deadline, series
        time.sleep(0.2)
