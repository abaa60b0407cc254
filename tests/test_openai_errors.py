"""`pagedllm openai`'s errors: bad requests to the real gateway (test_openai's fixtures: the
session's server and gateway) answer their exact status in OpenAI's shape, naming the
problem and showing no internals; Triton-side failures are errors, never an empty success."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import test_openai
from starlette.testclient import TestClient
from test_openai import MAX_TOKENS, MESSAGES, MODEL, PROMPT
from test_request_body import nested

from pagedllm.openai.app import GatewayConfig, create_app
from pagedllm.openai.errors import from_triton
from pagedllm.openai.request_body import MAX_BODY_BYTES
from pagedllm.openai.triton import Generation, TritonBridge, TritonError, make_inputs, request_error
from pagedllm.serving.tritonserver import TritonServer, free_port

model_dir, server, gateway = test_openai.model_dir, test_openai.server, test_openai.gateway
client = test_openai.client

JSON = {"Content-Type": "application/json"}
# what an error message must not show: a traceback, a source line, an absolute path, a class
INTERNALS = re.compile(r"Traceback|File \"|(^|[\s'\"(=:])/[\w.-]+/|\b[A-Z]\w*(Error|Exception)\b")
BUSY = "in ensemble 'ensemble', server busy: the waiting queue is full (8 requests)"
NAN, INF = float("nan"), float("inf")
CMPL, CHAT = "completions", "chat/completions"


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def user(content: Any, **fields: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": content, **fields}])


def raw(body: dict[str, Any], field: str, value: str) -> bytes:
    """`body` as JSON with `field` set to the JSON text `value` (too deep for json.dumps)."""
    return json.dumps({**body, field: "@@"}).replace('"@@"', value).encode()


# (id, endpoint, body, status, param, what the message says); headers and codes by id below
# fmt: off
CASES: list[tuple[str, str, dict[str, Any] | bytes, int, str | None, str]] = [
    # nesting: refused before json.loads (or pydantic, the chat template) recurses
    ("deep-body", CMPL, nested(10_000).encode(), 400, None, "nests arrays and objects too deeply"),
    ("deep-messages", CHAT, raw(chat(), "messages", f"[{nested(200)}]"), 400, None, "at most 64"),
    ("deep-stop", CMPL, raw(cmpl(), "stop", nested(65)), 400, None, "too deeply"),
    ("deep-logit-bias", CMPL, raw(cmpl(), "logit_bias", f'{{"1": {nested(99)}}}'), 400, None, "deep"),
    ("deep-response-format", CHAT, raw(chat(), "response_format", '{"a": ' * 70 + "1" + "}" * 70), 400, None, "deep"),
    ("not-an-object", CMPL, b"[1, 2]", 400, None, "must be a JSON object"),
    ("not-json", CMPL, b"{not json", 400, None, "not valid JSON"),
    ("not-utf8", CMPL, b'{"model": "\xff"}', 400, None, "not valid UTF-8"),
    ("number-too-long", CMPL, raw(cmpl(), "seed", "1" * 5000), 400, None, "too many digits"),
    ("too-large", CMPL, b" " * (MAX_BODY_BYTES + 1), 413, None, f"larger than {MAX_BODY_BYTES} bytes"),
    # media type: a web page can POST these cross-site without a CORS preflight
    ("text-plain", CMPL, cmpl(), 415, "Content-Type", "must be application/json (got 'text/plain')"),
    ("no-content-type", CHAT, chat(), 415, "Content-Type", "the request has none"),
    ("form", CMPL, cmpl(), 415, "Content-Type", "application/x-www-form-urlencoded"),
    # lone surrogates: JSON escapes spell them, UTF-8 cannot encode them
    ("surrogate-prompt", CMPL, cmpl(prompt="hi \ud800"), 400, "prompt", "lone surrogate"),
    ("surrogate-stream", CMPL, cmpl(prompt="\ud800", stream=True), 400, "prompt", "not valid Unicode"),
    ("surrogate-prompts", CMPL, cmpl(prompt=["ok", "\udfff"]), 400, "prompt[1]", "cannot be encoded"),
    ("surrogate-stop", CMPL, cmpl(stop=["a\udc00"]), 400, "stop[0]", "lone surrogate"),
    ("surrogate-content", CHAT, user("x\ud800"), 400, "messages[0].content", "lone surrogate"),
    ("surrogate-part", CHAT, user([{"type": "text", "text": "\ud800"}]), 400, "messages[0].content[0].text", "surrogate"),
    ("surrogate-chat-stream", CHAT, {**user("\ud800"), "stream": True}, 400, "messages[0].content", "surrogate"),
    ("surrogate-name", CHAT, user("x", name="a\ud800"), 400, "messages[0].name", "lone surrogate"),
    ("surrogate-model", CMPL, cmpl(model="\ud800"), 404, "model", "does not exist"),
    # floats: NaN and infinities (Python's json reads them) are no numbers to sample with
    ("temperature-nan", CMPL, cmpl(temperature=NAN), 400, "temperature", "must be a finite number"),
    ("top-p-inf", CMPL, cmpl(top_p=INF), 400, "top_p", "must be a finite number"),
    ("penalty-minus-inf", CHAT, chat(presence_penalty=-INF), 400, "presence_penalty", "finite number"),
    ("min-p-infinity", CMPL, raw(cmpl(), "min_p", "Infinity"), 400, "min_p", "must be a finite number"),
    # integers: the engine's int32 counts and 63-bit seeds, never wrapped around
    ("max-tokens", CMPL, cmpl(max_tokens=2**31), 400, "max_tokens", "valid range [1, 2147483647]"),
    ("max-completion-tokens", CHAT, chat(max_completion_tokens=2**31), 400, "max_completion_tokens", "[1, 2147483647]"),
    ("min-tokens", CMPL, cmpl(min_tokens=2**40), 400, "min_tokens", "valid range [0, 2147483647]"),
    ("top-k", CMPL, cmpl(top_k=2**31), 400, "top_k", "valid range [-1, 2147483647]"),
    ("seed", CMPL, cmpl(seed=2**64), 400, "seed", f"valid range [0, {2**63})"),
    ("n", CMPL, cmpl(n=10**30), 400, "n", "valid range [1, 16]"),
    ("logprobs", CMPL, cmpl(logprobs=2**40), 400, "logprobs", "valid range [0, 20]"),
    ("top-logprobs", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "valid range [0, 20]"),
    # token-id prompts: the bad id's position, the vocabulary's range (the tiny tokenizer's 368)
    ("id-too-large", CMPL, cmpl(prompt=[[1, 2], [5, 6, 7, 99999]]), 400, "prompt[1][3]", "prompt[1][3]: 99999 is not a token id (an integer from 0 to 367)"),
    ("id-vocab-size", CMPL, cmpl(prompt=[5, 368]), 400, "prompt[1]", "368 is not a token id"),
    ("id-negative", CMPL, cmpl(prompt=[3, -1]), 400, "prompt[1]", "prompt[1]: -1 is not a token id"),
    ("id-float", CMPL, cmpl(prompt=[3, 1.5]), 400, "prompt[1]", "1.5 is not a token id"),
    ("id-bool", CMPL, cmpl(prompt=[[True]]), 400, "prompt[0][0]", "true is not a token id"),
    ("id-string", CMPL, cmpl(prompt=[[1, "2"]]), 400, "prompt[0][1]", '"2" is not a token id'),
    ("id-nested", CMPL, cmpl(prompt=[[[1]]]), 400, "prompt[0][0]", "[1] is not a token id"),
    ("ids-then-id", CMPL, cmpl(prompt=[[1], 2]), 400, "prompt[1]", "must be a list of token ids"),
    ("string-then-ids", CMPL, cmpl(prompt=["a", [1]]), 400, "prompt[1]", "must be a string"),
    ("ids-empty", CMPL, cmpl(prompt=[[1], []]), 400, "prompt[1]", "prompt[1] must not be empty"),
    ("prompts-empty", CMPL, cmpl(prompt=[]), 400, "prompt", "prompt must not be empty"),
]
HEADERS = {"text-plain": {"Content-Type": "text/plain"}, "no-content-type": {},
           "form": {"Content-Type": "application/x-www-form-urlencoded"}}
# fmt: on
CODES = {"surrogate-model": 404}  # vLLM's NotFoundError for a model not served


def assert_error(
    r: httpx.Response, status: int, param: str | None, message: str, code: str | int | None = None
) -> str:
    """The error's message, once its status, shape and fields are as expected."""
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"]
    error = body["error"]
    assert (error["param"], error["code"]) == (param, code), error
    kind = "NotFoundError" if code == 404 else "invalid_request_error"
    assert error["type"] == (kind if status < 500 else "server_error"), error
    assert message in error["message"] and not INTERNALS.search(error["message"]), error
    return str(error["message"])


def greedy_answer(gateway: str) -> dict[str, Any]:
    body = cmpl(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    r = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return dict(r.json())


@pytest.fixture(scope="module")
def greedy(gateway: str) -> dict[str, Any]:
    """The answer to a good greedy request, before any bad one."""
    return greedy_answer(gateway)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(gateway: str, greedy: dict[str, Any], case: tuple[Any, ...]) -> None:
    name, path, body, status, param, message = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = HEADERS.get(name, JSON)
    r = httpx.post(f"{gateway}/v1/{path}", content=content, headers=headers, timeout=60)
    assert_error(r, status, param, message, CODES.get(name))


@pytest.mark.parametrize(
    "media", ["application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"]
)
def test_json_media_types_are_accepted(gateway: str, media: str) -> None:
    content = json.dumps(cmpl(max_tokens=2, ignore_eos=True)).encode()  # EOS may come first
    r = httpx.post(f"{gateway}/v1/completions", content=content, headers={"Content-Type": media})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_errors_in_openai_shape(client: openai.OpenAI, gateway: str) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert not_found.value.code == 404 and not_found.value.param == "model"

    bad: list[tuple[str, dict[str, Any], str, str]] = [
        ("completions", {"temperature": 5}, "temperature", "less than or equal to 2"),
        ("completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ("completions", {"extra_body": {"foo": 1}}, "foo", "Unrecognized request argument"),
        ("completions", {"max_tokens": 100_000}, "max_tokens", "exceeds the model's context"),
        ("completions", {"prompt": [[1, 2, 99999]]}, "prompt[0][2]", "is not a token id"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal"),
        ("chat", {"n": 0}, "n", "greater than or equal to 1"),
        ("chat", {"stream": True, "max_tokens": 100_000}, "max_tokens", "context"),
    ]
    for endpoint, kwargs, param, message in bad:
        with pytest.raises(openai.BadRequestError) as error:
            if endpoint == "chat":
                client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
            else:
                client.completions.create(model=MODEL, **{"prompt": PROMPT, **kwargs})
        assert error.value.param == param, (kwargs, error.value.body)
        assert message in error.value.message, (kwargs, error.value.body)
        assert error.value.type == "invalid_request_error"

    r = httpx.post(f"{gateway}/v1/completions", content=b"{not json", headers=JSON)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{gateway}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.put(f"{gateway}/v1/completions", json=cmpl())
    assert_error(r, 405, None, "Method Not Allowed")
    assert r.headers["allow"] == "POST"


# --- Triton's side ----------------------------------------------------------------------------


def test_triton_down_is_503(model_dir: Path) -> None:
    app = create_app(GatewayConfig(triton_url=f"127.0.0.1:{free_port()}", model_dir=str(model_dir)))
    with TestClient(app) as http:
        assert http.get("/health").status_code == 503
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as error:
                openai_client(http).completions.create(model=MODEL, prompt=PROMPT, stream=stream)
            assert error.value.status_code == 503
            assert "unavailable" in error.value.message


def test_busy_engine_is_429_with_retry_after() -> None:
    assert request_error(BUSY).status == request_error("server busy: full").status == 429
    assert request_error("the server is busy-ish, prompt too long").status == 400
    assert from_triton(request_error(BUSY), "prompt").headers() == {"Retry-After": "1"}


def text_result(text: bytes) -> Any:
    """An InferResult of one streamed response with `text` and no finish_reason."""
    return SimpleNamespace(
        as_numpy=lambda name: np.array([text]) if name == "text_output" else None
    )


class FakeCall:
    """A `stream_infer` call: reads the request, then yields or raises `responses`."""

    def __init__(self, requests: AsyncIterator[Any], responses: list[Any]) -> None:
        self.requests, self.responses = requests, responses

    async def __aiter__(self) -> AsyncIterator[Any]:
        await self.requests.__anext__()
        for item in self.responses:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> bool:
        return True


def fake_gateway(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, responses: list[Any]
) -> TestClient:
    """The gateway in process, its Triton client answering every request with `responses`."""
    fake = type(
        "FakeClient", (), {"stream_infer": lambda self, requests: FakeCall(requests, responses)}
    )
    monkeypatch.setattr(TritonBridge, "client", lambda self: fake())
    app = create_app(GatewayConfig(triton_url="127.0.0.1:1", model_dir=str(model_dir)))
    return TestClient(app, raise_server_exceptions=False)


def openai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{http.base_url}/v1", api_key="unused", max_retries=0, http_client=http
    )


@pytest.mark.parametrize("stream", [False, True])
def test_busy_engine_through_the_gateway(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """An error response saying "server busy" (before any chunk) is a plain 429."""
    error = type("Error", (), {"message": lambda self: BUSY})()
    http = fake_gateway(model_dir, monkeypatch, [(None, error)])
    with http, pytest.raises(openai.RateLimitError) as raised:
        openai_client(http).completions.create(model=MODEL, prompt=PROMPT, stream=stream)
    assert raised.value.response.headers["retry-after"] == "1"
    body: Any = raised.value.body  # the error object (the client's message format varies)
    assert raised.value.type == "rate_limit_error" and body["message"] == BUSY
    assert raised.value.code == "rate_limit_exceeded" and raised.value.param is None


@pytest.mark.parametrize(
    ("responses", "status", "message"),
    [
        # before: a silent 200 with empty text and usage 0, or a 500 "StopAsyncIteration"
        ([(text_result(b"Hi"), None)], 502, "ended without a final response"),
        # gRPC cancels a call whose request iterator raised: its responses raise CancelledError
        # in a task nobody cancelled, a failed request rather than a cancellation
        ([asyncio.CancelledError()], 500, "could not be sent to Triton"),
    ],
)
def test_broken_triton_streams_are_errors(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, responses: Any, status: int, message: str
) -> None:
    with fake_gateway(model_dir, monkeypatch, responses) as http:
        assert_error(http.post("/v1/completions", json=cmpl()), status, None, message)
        r = http.post("/v1/completions", json=cmpl(stream=True))
    if status == 500:  # nothing came: a plain error
        assert_error(r, status, None, message)
        return
    # the first chunk came, so the error is the stream's last event
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == "Hi"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and message in error["message"]


def generate(url: str, generation: Generation) -> list[Any]:
    """The chunks of `generation` from the server at `url`, by a fresh bridge."""

    async def run() -> list[Any]:
        bridge = TritonBridge(url)
        try:
            return [c async for c in bridge.generate(generation)]
        finally:
            await bridge.close()

    return asyncio.run(asyncio.wait_for(run(), 30))


def test_request_iterator_failure_surfaces(
    server: TritonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the request fails in tritonclient's request iterator, whose exception gRPC only
    logs: an error (500 or 502, as gRPC's cancel races the end of the stream), promptly."""
    import tritonclient.grpc.aio as grpcclient

    def fail(**kwargs: Any) -> Any:
        raise ValueError("cannot build the request")

    monkeypatch.setattr(grpcclient, "_get_inference_request", fail)
    with pytest.raises(TritonError) as raised:
        generate(server.grpc_url, Generation(PROMPT, {"max_tokens": 2}))
    assert raised.value.status in (500, 502)
    monkeypatch.undo()
    assert generate(server.grpc_url, Generation(PROMPT, {"max_tokens": 2}))[-1].finish_reason


def test_text_that_utf8_cannot_encode_never_reaches_grpc() -> None:
    for generation in (Generation("hi \ud800", {}), Generation("a", {"stop": ["\udc00"]})):
        with pytest.raises(TritonError, match="not valid Unicode"):
            make_inputs(generation)
    with pytest.raises(TritonError, match="finite"):
        make_inputs(Generation("a", {"temperature": NAN}))


def test_cancelling_the_consumer_still_cancels(server: TritonServer) -> None:
    """A CancelledError of the consumer's own cancellation is not turned into an error."""

    async def main() -> None:
        bridge, started = TritonBridge(server.grpc_url), asyncio.Event()
        long = Generation(PROMPT, {"max_tokens": 400, "ignore_eos": True})

        async def consume() -> None:
            async for _ in bridge.generate(long):
                started.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await bridge.close()

    asyncio.run(main())


def test_internal_errors_are_generic_and_logged(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("boom in /srv/secret/module.py")

    monkeypatch.setattr("pagedllm.openai.app.parse_body", broken)
    with fake_gateway(model_dir, monkeypatch, []) as http, caplog.at_level(logging.ERROR):
        r = http.post("/v1/completions", json=cmpl())
    message = assert_error(r, 500, None, "internal error (id ")
    error_id = message.split("(id ")[1].split(")")[0]
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and "boom in /srv/secret" in str(logged[0].exc_info and logged[0].exc_info[1])


def test_triton_internals_are_not_forwarded(caplog: pytest.LogCaptureFixture) -> None:
    message = (
        "Failed to process the request(s) for model 'llm_engine', message: KeyError: 'x'\n\n"
        "At:\n  /opt/pagedllm/model_repository/llm_engine/1/model.py(42): execute\n"
    )
    with caplog.at_level(logging.ERROR):
        error = from_triton(TritonError(400, message), "prompt")
    assert error.status == 500 and error.message.startswith("internal error (id ")
    assert "KeyError" in caplog.text
    kept = from_triton(TritonError(400, "max_tokens must be at least 1"), "prompt")
    assert (kept.status, kept.param) == (400, "max_tokens")


def test_still_serves_after_bad_requests(gateway: str, greedy: dict[str, Any]) -> None:
    after = greedy_answer(gateway)
    assert after["choices"] == greedy["choices"] and after["usage"] == greedy["usage"]
