"""The LoRA server of tests/test_lora_server.py and test_lora_gateway.py, started once per
session (conftest.py imports these fixtures): a tiny Llama with two PEFT adapters of
different ranks and targets (a third one is loaded while it runs), and the offline engine
with LoRA on, their oracle."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_adapters import save_adapter
from lora_serving import MAX_TOKENS
from test_server import PROMPT

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.request import RUNTIME_LORA_ENV
from pagedllm.serving.launcher import make_server
from pagedllm.serving.tritonserver import TritonServer

NAMES = ("all", "mlp_o")  # two of lora_adapters.ADAPTERS: different ranks and targets
RUNTIME = "qv"  # a third, loaded while the server runs


@pytest.fixture(scope="session")
def adapters(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora-server")
    base = checkpoints["llama"]
    return {n: str(save_adapter(base, root / n, n, seed=20)) for n in (*NAMES, RUNTIME)}


@pytest.fixture(scope="session")
def lora_server(
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


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def offline(lora_llm: LLM, adapters: dict) -> dict[str | None, tuple]:
    """Each adapter's (text, token ids), and the base model's under None, from the offline
    engine."""
    texts = offline_outputs(lora_llm, adapters, PROMPT, (None, *NAMES, RUNTIME))
    assert len({tuple(ids) for _, ids in texts.values()}) == 4  # each adapter changes them
    return texts
