"""The LoRA server (lora_server_fixtures.py) behind the OpenAI gateway, as vLLM's users call
it: adapters by model name (echoed), `/v1/models` with parents, runtime loading and unloading
behind vLLM's opt-in, vLLM's 404s, and vLLM's LoRA gauge."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jinja2
import openai
import pytest
import torch
import tritonclient.grpc.aio as grpcclient
from lora_server_fixtures import NAMES, RUNTIME, offline_outputs
from lora_serving import GREEDY, complete, lora_series, not_found, write_adapter
from openai_gateway import CHAT_TEMPLATE, running_gateway
from test_server import PROMPT

from pagedllm import LLM
from pagedllm.lora.request import RUNTIME_LORA_ENV
from pagedllm.openai.lora_resolver import CACHE_DIR_ENV
from pagedllm.serving.tritonserver import TritonServer


@pytest.fixture(scope="module")
def server(lora_server: TritonServer) -> TritonServer:
    """The session's LoRA server (lora_server_fixtures.py), not conftest's plain one."""
    return lora_server


# --- the OpenAI gateway (vLLM's LoRA interface) -----------------------------------------------


@pytest.fixture(scope="module")
def gateway(
    server: TritonServer,
    checkpoints: dict[str, Path],
    adapters: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """`pagedllm openai` in front of the LoRA server, runtime loading allowed and vLLM's
    filesystem resolver on (vLLM's env)."""
    work = tmp_path_factory.mktemp("lora-gateway")
    template = work / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = ("--chat-template", str(template))
    env = {RUNTIME_LORA_ENV: "true", CACHE_DIR_ENV: str(work / "cache")}
    for name, base in (("found", BASE), ("other_base", "elsewhere")):  # the resolver's folder
        shutil.copytree(adapters[RUNTIME], work / "cache" / name)
        config = json.loads((work / "cache" / name / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base
        (work / "cache" / name / "adapter_config.json").write_text(json.dumps(config))
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


def test_tokenize_takes_an_adapter_name(gateway: str, lora_llm: LLM) -> None:
    """vLLM's /tokenize and /detokenize answer for an adapter's name with the base tokenizer."""
    ids = lora_llm.engine.tokenizer.encode(PROMPT)
    for model in (BASE, "mlp_o"):
        r = httpx.post(f"{gateway}/tokenize", json={"model": model, "prompt": PROMPT})
        assert r.status_code == 200 and r.json()["tokens"] == ids, r.text
        r = httpx.post(f"{gateway}/detokenize", json={"model": model, "tokens": ids})
        assert r.status_code == 200 and r.json()["prompt"] == PROMPT, r.text
    not_found(httpx.post(f"{gateway}/tokenize", json={"model": "nope", "prompt": "x"}), "nope")
    not_found(httpx.post(f"{gateway}/detokenize", json={"model": RUNTIME, "tokens": [1]}), RUNTIME)


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


def test_the_filesystem_resolver_loads_an_unknown_name(
    client: openai.OpenAI, gateway: str, offline: dict[str | None, tuple]
) -> None:
    """vLLM's lora_filesystem_resolver: `found` (the `qv` adapter's files, for this base) is
    loaded on first use and then listed; a folder for another base, a name reaching outside the
    folder and a missing one stay vLLM's 404."""
    assert complete(client, "found") == offline[RUNTIME][0]
    assert "found" in {c["id"] for c in httpx.get(f"{gateway}/v1/models").json()["data"]}
    assert complete(client, "found") == offline[RUNTIME][0]  # now a loaded adapter
    for name in ("other_base", "../cache/found", "missing"):
        body = {"model": name, "prompt": PROMPT, "max_tokens": 2}
        not_found(httpx.post(f"{gateway}/v1/completions", json=body), name)
    r = httpx.post(f"{gateway}/v1/unload_lora_adapter", json={"lora_name": "found"})
    assert r.status_code == 200, r.text


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
