"""The real default model (SmolLM2-135M-Instruct) through the ensemble on a real tritonserver:
multi-byte output (Japanese, emoji) streamed over gRPC equals the non-streamed text, the
offline API's text and tokenizer.decode(ids) — including an output that ends in the middle of
a character (flushed as U+FFFD, as a full decode shows it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import GrpcStream, post, wait_idle

from pagedllm import LLM, SamplingParams
from pagedllm.prepare import prepare_smollm2
from pagedllm.serving.launcher import make_server
from pagedllm.serving.tritonserver import TritonServer

pytestmark = pytest.mark.slow

PROMPTS = [
    "<|im_start|>user\nSay hello in Japanese and add an emoji.<|im_end|>\n<|im_start|>assistant\n",
    # greedy: emoji after emoji; the 32nd token ends inside one
    "Here are some emojis: 😀🚀🎉 and Chinese: 你好世界. More:",
    "Once upon a time,",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return prepare_smollm2()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with make_server(
        str(model_dir), dtype="float32", work_dir=tmp_path_factory.mktemp("triton")
    ) as s:
        yield s


def test_multibyte_streaming_is_exact(server: TritonServer, model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    offline = llm.generate(PROMPTS, params, use_tqdm=False)
    streams = [
        GrpcStream(server, {"text_input": p, "max_tokens": MAX_TOKENS, "temperature": 0.0})
        for p in PROMPTS
    ]
    for prompt, stream, out in zip(PROMPTS, streams, offline, strict=True):
        expected = out.outputs[0].text
        assert expected == llm.engine.tokenizer.decode(out.outputs[0].token_ids)
        assert stream.wait() == expected
        deltas = [r["text_output"] for _, r in stream.responses]
        assert all("\ufffd" not in d for d in deltas[:-1])  # no half characters on the way
        _, text = post(
            f"{server.http_url}/v2/models/ensemble/generate",
            {
                "text_input": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "exclude_input_in_output": True,
            },
        )
        assert json.loads(text)["text_output"] == expected
    texts = [o.outputs[0].text for o in offline]
    assert sum(ord(c) > 0x7FF for c in texts[0]) >= 3  # Japanese, 3-byte UTF-8
    assert texts[1].count("🎉") >= 5 and texts[1].endswith("\ufffd")  # cut inside a character
    assert texts[2].startswith(" the city of Nova Haven")
    assert wait_idle(server, timeout=5) < 5
