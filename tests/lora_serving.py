"""Helpers of the LoRA server tests (tests/test_lora_server.py): the gateway's greedy
completions, vLLM's not-found answer, malformed adapter folders, vLLM's LoRA gauge read from
Triton's metrics."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import httpx
import openai
from test_server import PROMPT

MAX_TOKENS = 12
GREEDY: dict = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


def complete(client: openai.OpenAI, model: str) -> str:
    """The non-streamed text, and the streamed one checked equal; `model` echoed in both."""
    out = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY))
    assert out.model == model and {c.model for c in chunks} == {model}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    return out.choices[0].text


def not_found(response: httpx.Response, model: str) -> None:
    """vLLM's answer to a model the server does not serve."""
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["message"] == f"The model `{model}` does not exist."
    assert (error["type"], error["code"], error["param"]) == ("NotFoundError", 404, "model")


def write_adapter(folder: Path, config: dict, tensors: dict | None = None) -> str:
    """An adapter folder as given (a malformed one)."""
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, folder / "adapter_model.safetensors")
    return str(folder)


def lora_series(metrics_url: str) -> dict[tuple[str, str, str], float]:
    """vllm:lora_requests_info's series: (max_lora, running, waiting) -> its value (when that
    state was last seen, as vLLM sets it)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    series = {}
    for labels, value in re.findall(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", text, re.M):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        state = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
        series[tuple(named[k] for k in state)] = float(value)
    return series
