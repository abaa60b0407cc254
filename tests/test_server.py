"""The model repository on a real tritonserver (nvidia-pytriton wheel, CPU), queried with real
clients: the `ensemble` (tokenizer -> llm_engine -> detokenizer) over HTTP generate /
generate_stream and tritonclient gRPC streaming; the `llm` entry point over KServe v2 infer
(HTTP and unary gRPC). The oracle is the offline `LLM` API on the same checkpoint."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import server_metrics
import torch
from grpc_stream import GrpcStream, grpc_inputs

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.serving.tritonserver import TritonServer

SHARES_SERVER = True  # conftest's session server: requests only, metrics read as deltas
PROMPT = "Once upon a time"
MAX_TOKENS = 12


def offline_text(llm: LLM, prompt: str = PROMPT, stream: bool = False, **params: Any) -> str:
    """The offline API's text, or (stream=True) its streamed deltas joined."""
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **params}
    if not stream:
        return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    delta = SamplingParams(**params, output_kind=RequestOutputKind.DELTA)
    llm.engine.add_request("offline-stream", prompt, delta)
    texts = []
    while llm.engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in llm.engine.step()]
    return "".join(texts)


@pytest.fixture(scope="module")
def offline(llm: LLM) -> str:
    return offline_text(llm)


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def body(**extra: Any) -> dict[str, Any]:
    return {
        "text_input": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "sampling_parameters": json.dumps({"ignore_eos": True}),
        **extra,
    }


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def metrics(server: TritonServer) -> dict[str, float]:
    """The vllm:* samples of the server's metrics endpoint (see server_metrics.py)."""
    return server_metrics.metrics(server.metrics_url)


def wait_idle(server: TritonServer, timeout: float) -> float:
    """Seconds until no request runs or waits and no KV block is in use."""
    return server_metrics.wait_idle(server.metrics_url, timeout)


def test_llm_engine_is_one_kind_model_instance_on_the_device_auto_chose(
    server: TritonServer,
) -> None:
    """config.pbtxt as Triton loaded it: one KIND_MODEL instance (no GPU here, none needed);
    its engine's `device` "auto" resolved and logged once."""
    url = f"{server.http_url}/v2/models/llm_engine/config"
    with urllib.request.urlopen(url, timeout=30) as r:
        config = json.load(r)
    assert [(g["kind"], g["count"]) for g in config["instance_group"]] == [("KIND_MODEL", 1)]
    assert config["parameters"]["device"]["string_value"] == "auto"
    log = server.log_path.read_text()
    chosen = "cuda:0 (" if torch.cuda.is_available() else "cpu (no CUDA device)"
    assert log.count(f"device auto -> {chosen}") == 1, log[-2000:]


# --- the same text as the offline API, over every protocol -----------------------------------


def test_http_generate_matches_offline(server: TritonServer, offline: str) -> None:
    status, text = post(f"{server.http_url}/v2/models/ensemble/generate", body())
    assert status == 200, text
    out = json.loads(text)
    assert out["text_output"] == PROMPT + offline  # the prompt first, as Triton's backends do
    assert out["finish_reason"] == "length" and out["num_output_tokens"] == MAX_TOKENS
    assert out["num_input_tokens"] > 0
    status, text = post(
        f"{server.http_url}/v2/models/ensemble/generate", body(exclude_input_in_output=True)
    )
    assert json.loads(text)["text_output"] == offline


def test_http_generate_stream_concatenates_to_offline(server: TritonServer, offline: str) -> None:
    status, text = post(f"{server.http_url}/v2/models/ensemble/generate_stream", body(stream=True))
    assert status == 200
    events = sse_events(text)
    assert len(events) == MAX_TOKENS  # one response per generated token
    assert [e["index"] for e in events] == list(range(MAX_TOKENS))
    assert [e["num_output_tokens"] for e in events] == list(range(1, MAX_TOKENS + 1))
    assert "".join(e["text_output"] for e in events) == offline
    assert [e["finish_reason"] for e in events] == [""] * (MAX_TOKENS - 1) + ["length"]


def test_token_ids_and_log_probs(server: TritonServer, llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    expected = [next(iter(d.values())).logprob for d in out.logprobs or []]
    _, text = post(
        f"{server.http_url}/v2/models/ensemble/generate_stream",
        body(stream=True, return_log_probs=True),
    )
    events = sse_events(text)

    def items(value: Any) -> list[Any]:  # Triton's generate JSON shows [x] as x
        return value if isinstance(value, list) else [value]

    assert [t for e in events for t in items(e["output_token_ids"])] == out.token_ids
    logprobs = [lp for e in events for lp in items(e["output_log_probs"])]
    assert logprobs == pytest.approx(expected, abs=1e-4)
    _, text = post(f"{server.http_url}/v2/models/ensemble/generate", body())
    assert json.loads(text)["output_token_ids"] == out.token_ids
    assert json.loads(text)["output_log_probs"] == []  # not asked


def test_grpc_streaming_with_tritonclient(server: TritonServer, offline: str) -> None:
    stream = GrpcStream(
        server,
        {
            "text_input": PROMPT,
            "max_tokens": MAX_TOKENS,
            "sampling_parameters": '{"temperature": 0, "ignore_eos": true}',
        },
    )
    assert stream.wait() == offline
    assert stream.responses[-1][1]["finish_reason"] == "length"


def test_kserve_v2_infer_over_http_and_grpc(server: TritonServer, offline: str) -> None:
    import tritonclient.grpc as grpcclient

    inputs = [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]},
        {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [MAX_TOKENS]},
        {"name": "temperature", "shape": [1], "datatype": "FP32", "data": [0.0]},
        {"name": "ignore_eos", "shape": [1], "datatype": "BOOL", "data": [True]},
    ]
    status, text = post(f"{server.http_url}/v2/models/llm/infer", {"inputs": inputs})
    assert status == 200, text
    outputs = {o["name"]: o["data"] for o in json.loads(text)["outputs"]}
    assert outputs["text_output"] == [PROMPT + offline]
    assert outputs["finish_reason"] == ["length"]
    assert outputs["num_output_tokens"] == [MAX_TOKENS]

    client = grpcclient.InferenceServerClient(server.grpc_url)
    values = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    result = client.infer("llm", grpc_inputs({**values, "ignore_eos": True}))
    assert result.as_numpy("text_output")[0].decode() == PROMPT + offline
    # an error reaches a unary client as an error, with the reason
    with pytest.raises(Exception, match="max_tokens must be at least 1"):
        client.infer("llm", grpc_inputs({**values, "max_tokens": 0}))


def test_stop_strings_through_the_ensemble(server: TritonServer, llm: LLM) -> None:
    full = offline_text(llm, max_tokens=24)
    stop = full[8:11]  # a stop string in the middle of the output (here: random text)
    expected = offline_text(llm, max_tokens=24, stop=[stop])
    assert expected == full[: full.index(stop)]
    params = json.dumps({"ignore_eos": True, "stop": [stop]})
    _, text = post(
        f"{server.http_url}/v2/models/ensemble/generate_stream",
        body(stream=True, max_tokens=24, sampling_parameters=params),
    )
    events = sse_events(text)
    assert "".join(e["text_output"] for e in events) == expected
    assert events[-1]["finish_reason"] == "stop"
    _, text = post(
        f"{server.http_url}/v2/models/ensemble/generate",
        body(max_tokens=24, sampling_parameters=params, exclude_input_in_output=True),
    )
    assert json.loads(text)["text_output"] == expected


def test_streamed_text_through_the_detokenizer_equals_the_engines(
    server: TritonServer, llm: LLM
) -> None:
    """The tiny model's random weights emit arbitrary byte-level tokens: characters split
    across responses, invalid UTF-8. The stateless detokenizer streams what the offline
    engine streams, and the non-streamed text is tokenizer.decode(ids). (For valid UTF-8 the
    two are equal: tests/test_detokenizer.py, and test_smollm2_server.py with real output.)"""
    tok = llm.engine.tokenizer
    for prompt in ("Grüße aus Köln", "東京は晴れです", "😀🚀", "Paged attention"):
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        ids = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        extra = {"text_input": prompt, "max_tokens": 20}
        _, text = post(
            f"{server.http_url}/v2/models/ensemble/generate_stream", body(stream=True, **extra)
        )
        deltas = [e["text_output"] for e in sse_events(text)]
        assert "".join(deltas) == offline_text(llm, prompt, stream=True, max_tokens=20)
        _, text = post(
            f"{server.http_url}/v2/models/ensemble/generate",
            body(**extra, exclude_input_in_output=True),
        )
        assert json.loads(text)["text_output"] == tok.decode(ids)


# --- concurrency, cancellation, bad input ------------------------------------------------------


def test_16_concurrent_streams_interleave_and_match_solo_outputs(
    server: TritonServer, llm: LLM
) -> None:
    prompts = [f"Request {i}: once upon a time" for i in range(16)]
    lengths = [160 + (i % 4) * 16 for i in range(16)]
    solo = [
        offline_text(llm, p, stream=True, max_tokens=n)
        for p, n in zip(prompts, lengths, strict=True)
    ]
    streams = [
        GrpcStream(
            server,
            {"text_input": p, "max_tokens": n, "temperature": 0.0, "ignore_eos": True},
            send=False,
        )
        for p, n in zip(prompts, lengths, strict=True)
    ]
    for stream in streams:
        stream.send()
    texts = [stream.wait() for stream in streams]
    assert texts == solo
    # batched, not serialized: every stream had its first token before any stream finished
    first = max(s.responses[0][0] for s in streams)
    last = min(s.responses[-1][0] for s in streams)
    assert first < last
    assert wait_idle(server, timeout=5) < 5


# Cancelled requests run on the slow checkpoint (conftest): a cancel is seen at the next poll
# (every 0.2 s), and the tiny model's 480 tokens (~0.5 s) could end by length before it under
# load (abort + 0); these run for seconds.
SLOW_LEN = 2000


def test_cancelling_a_stream_frees_its_blocks_within_a_second(
    slow_shared_server: TritonServer, slow_checkpoint: Path
) -> None:
    server = slow_shared_server
    aborted = metrics(server).get("vllm:request_success_total{finished_reason=abort}", 0)
    stream = GrpcStream(
        server,
        {"text_input": PROMPT, "max_tokens": SLOW_LEN, "temperature": 0.0, "ignore_eos": True},
    )
    while len(stream.responses) < 5:
        time.sleep(0.005)
    # the gauges are published on their own thread: they may trail the responses a little
    server_metrics.wait_running(server.metrics_url, 1, timeout=10)
    stream.cancel()
    assert wait_idle(server, timeout=1.0) < 1.0
    m = metrics(server)
    assert m.get("vllm:request_success_total{finished_reason=abort}") == aborted + 1, m
    assert len(stream.responses) < SLOW_LEN
    assert "cancelled by its client" in server.log_path.read_text()  # logged, as vllm_backend
    # the server is healthy and serves the next request exactly
    status, text = post(
        f"{server.http_url}/v2/models/ensemble/generate", body(exclude_input_in_output=True)
    )
    offline = offline_text(LLM(str(slow_checkpoint), dtype="float32"))
    assert status == 200 and json.loads(text)["text_output"] == offline


def test_cancelling_a_direct_llm_engine_stream_frees_its_blocks_within_a_second(
    slow_shared_server: TritonServer,
) -> None:
    """A client of the decoupled llm_engine itself (no ensemble): its cancel is seen through
    the response sender, asked at most every 0.2 s per request."""
    server = slow_shared_server
    aborted = metrics(server).get("vllm:request_success_total{finished_reason=abort}", 0)
    stream = GrpcStream(
        server,
        {"text_input": PROMPT, "max_tokens": SLOW_LEN, "temperature": 0.0, "ignore_eos": True},
        model="llm_engine",
    )
    while stream.received < 20:
        time.sleep(0.005)
    server_metrics.wait_running(server.metrics_url, 1, timeout=10)  # the gauges trail
    stream.cancel()
    assert wait_idle(server, timeout=1.0) < 1.0
    m = metrics(server)
    assert m.get("vllm:request_success_total{finished_reason=abort}") == aborted + 1, m
    assert stream.received < SLOW_LEN


BAD_REQUESTS = [
    ({"sampling_parameters": "{not json"}, "not valid JSON"),
    ({"sampling_parameters": '{"max_tokenz": 3}'}, "unknown sampling parameters: max_tokenz"),
    ({"text_input": ""}, "prompt is empty"),
    ({"text_input": "word " * 600}, "the model's context is 512 tokens"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"max_tokens": 10**6}, "exceeds the model's context"),
    ({"temperature": -1.0}, "temperature must be non-negative"),
    # refused by Triton's HTTP frontend before any model runs (HTTP 500 there)
    ({"max_tokens": "many"}, "Unable to parse 'data'"),  # wrong dtype for an INT32 input
    ({"text_input": None}, "text_input"),  # missing
]


def test_bad_requests_get_errors_while_good_streams_go_on(server: TritonServer, llm: LLM) -> None:
    import tritonclient.grpc as grpcclient

    good_prompt = "A long good request"
    expected = offline_text(llm, good_prompt, stream=True, max_tokens=200)
    good = GrpcStream(
        server,
        {"text_input": good_prompt, "max_tokens": 200, "temperature": 0.0, "ignore_eos": True},
    )
    for bad, message in BAD_REQUESTS:
        request = {k: v for k, v in {**body(), **bad}.items() if v is not None}
        status, text = post(f"{server.http_url}/v2/models/ensemble/generate", request)
        assert status in (400, 500) and message in text, (bad, status, text)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    # bytes that are not UTF-8
    with pytest.raises(Exception, match="text_input is not valid UTF-8"):
        client.infer("llm", grpc_inputs({"text_input": b"\xff\xfe caf\xc3"}))
    # two prompts in one request: the wrong shape
    two = grpcclient.InferInput("text_input", [2], "BYTES")
    two.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
    with pytest.raises(Exception, match="text_input"):
        client.infer("llm", [two])
    assert good.wait() == expected  # undisturbed
    assert wait_idle(server, timeout=5) < 5


def test_metrics_count_what_was_sent_and_received(server: TritonServer) -> None:
    wait_idle(server, timeout=5)
    before = metrics(server)
    lengths = [3, 5, 8]
    prompt_tokens = 0
    for i, n in enumerate(lengths):
        status, text = post(
            f"{server.http_url}/v2/models/ensemble/generate",
            body(text_input=f"metrics {i}: {PROMPT}", max_tokens=n),
        )
        assert status == 200, text
        out = json.loads(text)
        assert out["num_output_tokens"] == n
        prompt_tokens += out["num_input_tokens"]
    wait_idle(server, timeout=5)
    after = metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == sum(lengths)
    assert delta("vllm:request_success_total{finished_reason=length}") == len(lengths)
    assert delta("vllm:time_to_first_token_seconds_count") == len(lengths)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(lengths)
    assert delta("vllm:request_queue_time_seconds_count") == len(lengths)
    assert delta("vllm:time_per_output_token_seconds_count") == sum(n - 1 for n in lengths)
    assert delta("vllm:request_generation_tokens_sum") == sum(lengths)
    assert delta("vllm:prefix_cache_queries_total") == prompt_tokens


def test_timing_outputs_on_request(server: TritonServer) -> None:
    start = time.monotonic()
    _, text = post(
        f"{server.http_url}/v2/models/ensemble/generate_stream",
        body(stream=True, return_timing=True),
    )
    elapsed_ms = (time.monotonic() - start) * 1000
    events = sse_events(text)
    assert all("queue_time_ms" not in e for e in events[:-1])  # the last response only
    last = events[-1]
    assert 0 <= last["queue_time_ms"] <= last["time_to_first_token_ms"] < elapsed_ms
    _, text = post(f"{server.http_url}/v2/models/ensemble/generate", body())
    assert "queue_time_ms" not in json.loads(text)  # not asked
    _, text = post(f"{server.http_url}/v2/models/ensemble/generate", body(return_timing=True))
    assert json.loads(text)["time_to_first_token_ms"] > 0
