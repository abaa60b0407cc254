"""vLLM's `use_beam_search` on /v1/completions through `pagedllm openai` (test_openai's real
tritonserver and gateway, tiny llama fp32). Oracle: `LLM.beam_search` on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_openai
from test_openai_vllm_fields import post, refused

from pagedllm import LLM
from pagedllm.beam_search import BeamSearchParams

model_dir, server, gateway = test_openai.model_dir, test_openai.server, test_openai.gateway
PROMPTS = ["Once upon a time", "The capital of"]
BEAMS: dict[str, Any] = {"use_beam_search": True, "n": 3, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32")


def expected(llm: LLM, prompt: str, length_penalty: float = 1.0) -> list[str]:
    params = BeamSearchParams(3, 6, ignore_eos=True, length_penalty=length_penalty)
    (out,) = llm.beam_search([prompt], params)
    n = len(llm.engine.tokenizer.encode(prompt))
    return [llm.engine.tokenizer.decode(s.tokens[n:]) for s in out.sequences]


def test_the_choices_are_the_beams_best_first(gateway: str, llm: LLM) -> None:
    r = post(gateway, "completions", {"prompt": PROMPTS, **BEAMS})
    assert r.status_code == 200, r.text
    answer = r.json()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["text"] for c in choices] == expected(llm, PROMPTS[0]) + expected(llm, PROMPTS[1])
    assert {c["finish_reason"] for c in choices} == {"length"}
    assert answer["usage"]["completion_tokens"] == 6 * 6
    # as vLLM, a beam search is never streamed: `stream` gives the same JSON completion
    streamed = post(gateway, "completions", {"prompt": PROMPTS, **BEAMS, "stream": True})
    assert streamed.headers["content-type"].startswith("application/json")
    assert streamed.json()["choices"] == choices
    lp = {"prompt": PROMPTS[0], **BEAMS, "length_penalty": 0.5, "echo": True}
    echoed = post(gateway, "completions", lp).json()["choices"]
    assert [c["text"] for c in echoed] == [PROMPTS[0] + t for t in expected(llm, PROMPTS[0], 0.5)]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 11}, "n"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_beams_cannot_serve_is_a_400(gateway: str, extra: dict[str, Any], param: str) -> None:
    error = refused(gateway, "completions", {"prompt": PROMPTS[0], **BEAMS, **extra})
    assert error["param"] == param
