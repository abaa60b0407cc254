"""`stream_interval` on a real tritonserver (PAGEDLLM_STREAM_INTERVAL=4): a streamed request
gets its first token at once, then one response per 4 tokens, the rest with the last; the
responses together carry exactly the offline engine's text and token ids, over gRPC
(tritonclient) and HTTP generate_stream. A request that is not streamed is not affected."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import GrpcStream, body, offline_text, post, sse_events

from pagedllm import LLM
from pagedllm.serving.launcher import make_server
from pagedllm.serving.tritonserver import TritonServer

INTERVAL = 4
MAX_TOKENS = 11  # 1 + 4 + 4 + 2


@pytest.fixture(scope="module")
def server(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    work = tmp_path_factory.mktemp("triton-interval")
    env = {"PAGEDLLM_STREAM_INTERVAL": str(INTERVAL)}
    with make_server(str(checkpoints["llama"]), dtype="float32", work_dir=work, env=env) as s:
        yield s


def test_streams_carry_every_token_in_fewer_responses(server: TritonServer, llm: LLM) -> None:
    offline = offline_text(llm, max_tokens=MAX_TOKENS)
    sizes = [1, 4, 4, 2]
    counts = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    stream = GrpcStream(
        server,
        {
            "text_input": "Once upon a time",
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    assert stream.wait() == offline  # indexes 0, 1, 2, 3: in order, none lost
    assert [r["num_output_tokens"] for _, r in stream.responses] == counts
    assert stream.responses[-1][1]["finish_reason"] == "length"

    _, text = post(
        f"{server.http_url}/v2/models/ensemble/generate_stream",
        body(stream=True, max_tokens=MAX_TOKENS),
    )
    events = sse_events(text)
    assert [e["num_output_tokens"] for e in events] == counts
    assert [
        len(e["output_token_ids"]) if isinstance(e["output_token_ids"], list) else 1 for e in events
    ] == sizes
    assert "".join(e["text_output"] for e in events) == offline
    assert [e["finish_reason"] for e in events] == ["", "", "", "length"]

    status, text = post(f"{server.http_url}/v2/models/ensemble/generate", body(max_tokens=5))
    assert status == 200 and json.loads(text)["num_output_tokens"] == 5
