"""Speculative decoding served: a real tritonserver started with PAGEDLLM_SPECULATIVE_CONFIG
(n-gram) streams, over gRPC (tritonclient) and HTTP generate_stream, exactly the text of the
offline engine without speculation; some responses carry several tokens (accepted drafts), and
the vllm:spec_decode_* counters on /metrics move by what was drafted and accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import GrpcStream, metrics, offline_text, post, sse_events, wait_idle

from pagedllm import LLM
from pagedllm.serving.launcher import make_server
from pagedllm.serving.tritonserver import TritonServer

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# a prompt that repeats itself: the tiny random model's greedy answer falls into cycles too,
# so n-gram drafts are proposed and some accepted
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
MAX_TOKENS = 32
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@pytest.fixture(scope="module")
def server(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    work = tmp_path_factory.mktemp("triton-spec")
    env = {"PAGEDLLM_SPECULATIVE_CONFIG": json.dumps(SPEC)}
    with make_server(str(checkpoints["llama"]), dtype="float32", work_dir=work, env=env) as s:
        yield s


def spec_counters(server: TritonServer) -> dict[str, float]:
    m = metrics(server)
    out = {k: m.get(k, 0.0) for k in (DRAFTS, DRAFT_TOKENS, ACCEPTED)}
    out[PER_POS] = sum(v for k, v in m.items() if k.startswith(PER_POS))
    return out


def test_streams_equal_no_speculation_and_counters_move(server: TritonServer, llm: LLM) -> None:
    assert llm.engine.scheduler.spec is None  # the oracle: the offline engine, no speculation
    expected = offline_text(llm, PROMPT, max_tokens=MAX_TOKENS)
    before = spec_counters(server)

    stream = GrpcStream(
        server,
        {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
    )
    assert stream.wait() == expected
    counts = [r["num_output_tokens"] for _, r in stream.responses]
    assert counts[-1] == MAX_TOKENS
    steps = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    assert max(steps) > 1  # a verified step brought accepted drafts in one response
    assert stream.responses[-1][1]["finish_reason"] == "length"

    request = {
        "text_input": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "sampling_parameters": json.dumps({"ignore_eos": True}),
        "stream": True,
    }
    status, text = post(f"{server.http_url}/v2/models/ensemble/generate_stream", request)
    assert status == 200
    events = sse_events(text)
    assert "".join(e["text_output"] for e in events) == expected
    assert events[-1]["num_output_tokens"] == MAX_TOKENS

    wait_idle(server, 10)  # the rejected tails' blocks were all given back
    after = spec_counters(server)
    delta = {k: after[k] - before[k] for k in after}
    assert delta[DRAFTS] > 0
    assert delta[DRAFT_TOKENS] >= delta[DRAFTS]  # each draft proposes at least one token
    assert 0 < delta[ACCEPTED] <= delta[DRAFT_TOKENS]
    assert delta[PER_POS] == delta[ACCEPTED]  # accepted tokens, counted by position
