"""Soak test: one real tritonserver and the OpenAI gateway under a mix of concurrent clients over
every protocol for --minutes, with cancels, disconnects and malformed requests. Prints JSON (and
writes it with --output); exits 1 unless every `checks` count is 0.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--model DIR | --tiny] [--dtype float32]
                                        [--concurrency 6] [--seed 0] [--output FILE]

Set-up: `tritonserver` (`pagedllm.serving.launcher.make_server`) with SmolLM2-135M-Instruct in
float32 (or --model DIR; --tiny builds a tiny random llama checkpoint with a chat template in a
temporary directory, for a quick run) and `pagedllm openai` as a subprocess in front of it.

Oracle: a few prompt specs (prompt, max_tokens, stop strings; greedy with ignore_eos), each
asked once at start, one request at a time, over each protocol family: `whole` (HTTP generate,
non-streamed: also the KServe `llm` and non-streamed gRPC answers), `stream` (gRPC streaming,
deltas joined: also HTTP generate_stream and the gateway's completions, which stream from
Triton) and `chat` (the gateway's chat completions). During the soak every completed greedy
request with one of these specs must give the same text. The engine is batch-invariant in
float32 only: with another --dtype a different text is reported, but does not fail the run.

Load: --concurrency worker threads, each sending one request at a time, picked at random
(MIX): the protocols (HTTP generate / generate_stream and KServe infer on `llm`; unary gRPC
infer on `llm`; gRPC streaming on `ensemble` with stream true and false; the gateway's
/v1/completions and /v1/chat/completions, streamed or not), greedy or sampled, non-streamed
Triton texts with or without the prompt (exclude_input_in_output); cancels (gRPC
stop_stream(cancel_requests=True) after a few responses, HTTP and gateway streams closed
mid-stream), disconnects (unary gRPC with a short client_timeout, a gateway or HTTP generate
client that closes its connection while waiting); and BAD_REQUESTS, which must get a 4xx (gRPC
INVALID_ARGUMENT, or an error on the stream). A busy server's refusal (429, 503, "server busy")
counts as `busy`, not as a failure. NOTE: Triton's HTTP frontend does not cancel a
non-streamed request whose client disconnected (it notices only when it writes the answer), so
those requests run to their end: not counted as cancels.

Checks, each a count that must be 0:
- hung: no end within --request-timeout (a client blocked past it where no timeout reaches,
  e.g. in tritonclient's stop_stream, is found when the load stops);
- lost: an answer that ended without its last part (no finish_reason, response indexes not
  0..n-1, the connection closed, a broken body);
- wrong_text: a greedy text that differs from the oracle's (not counted unless float32);
- unexpected_5xx: HTTP 5xx, gRPC INTERNAL / UNKNOWN / UNAVAILABLE (other than "server busy"),
  or a message that says "internal error" (Triton's generate answers every model error 400);
- unexpected_error: a good request refused, or a bad one accepted;
- kv_not_at_rest: vllm:num_requests_running, _waiting and vllm:kv_cache_usage_perc not all 0
  within --idle-timeout s after the load;
- engine_finished_minus_requests_sent: the requests the engine finished during the soak
  (vllm:request_success_total, stop + length + abort) minus the requests the clients sent it
  (answered, cancelled or disconnected; bad and refused ones never reach it): each started
  request finished exactly once;
- server_restarted, stubs_restarted: the tritonserver process exited, a stub's pid changed.

Also reported: requests per protocol and outcome, latency per protocol, the engine's counters
over the soak (aborts among them, next to the cancels sent), and the RSS, open file descriptors
and threads of tritonserver, each stub and the gateway at the start, midway and at the end,
with their change per 1,000 requests over the whole soak and over its second half.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from pagedllm.serving.launcher import make_server
from pagedllm.serving.tritonserver import TritonServer, free_port
from pagedllm.text.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))
import server_metrics  # noqa: E402  (tests/server_metrics.py)

# the tokenizer's and llm's max_prompt_bytes (docs/serving.md); the launcher passes the
# environment on, so PAGEDLLM_MAX_PROMPT_BYTES changes both
MAX_PROMPT_BYTES = int(os.environ.get("PAGEDLLM_MAX_PROMPT_BYTES") or 1 << 20)
LONG = 160  # max_tokens of requests that are cancelled: still running when the cancel comes
JSON = "application/json"
ABORTED = "vllm:request_success_total{finished_reason=abort}"
# a ChatML-like template for --tiny (test_openai's): the tiny tokenizer has no template
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s>' + message['role'] + '\\n' + message['content'] + "
    "'</s>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)
PROMPTS = [
    "Once upon a time,",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain paged attention in one sentence.",
    "Grüße aus Köln! 東京は晴れです。 Translate this.",
]
WORDS = (  # noqa: SIM905
    "time river light stone garden window morning silver paper engine market winter forest "
    "signal harbor letter mountain bridge candle violet thunder orchard lantern meadow canyon "
    "pocket ribbon castle feather compass marble needle planet rocket saddle tunnel velvet"
).split()


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


# --- what is asked -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A prompt and its parameters (greedy requests with it are checked against the oracle)."""

    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """One request of the soak. `kind`: good, cancel (mid-stream, or a gRPC deadline / closed
    connection while waiting), disconnect (HTTP non-streamed: not cancelled upstream) or bad."""

    protocol: str
    kind: str
    spec: Spec
    greedy: bool = True
    bad: str = ""  # the BAD_REQUESTS case
    cancel_after: int = 0  # responses (streams) before the cancel
    cancel_seconds: float = 0.0  # seconds before a disconnect (non-streamed)
    seed: int = 0
    echo: bool = False  # the prompt first in a non-streamed Triton text (the default there)

    def sampling(self) -> dict[str, Any]:
        """vLLM-named parameters (the JSON object Triton gets; the gateway's fields)."""
        params: dict[str, Any] = {"ignore_eos": True}
        if self.greedy:
            params["temperature"] = 0
        else:
            params.update(temperature=0.8, top_p=0.95, seed=self.seed)
        if self.spec.stop:
            params["stop"] = list(self.spec.stop)
        return params


@dataclass
class Reply:
    """How a request ended, as the client saw it. `end`: final (its last response arrived),
    error (an error answer), cancelled (the client cancelled or left, as planned), timeout (no
    end within the request timeout), truncated (the answer ended without its final part)."""

    end: str
    text: str = ""
    finish_reason: str = ""
    status: int | None = None  # HTTP status
    code: str = ""  # gRPC status code name; "" for an error on a stream
    message: str = ""


def make_specs(tokenizer: Tokenizer, context: int, count: int, rng: random.Random) -> list[Spec]:
    """`count` specs: the PROMPTS, then prompts of random words of 32 to 256 tokens (shorter for
    a small context); max_tokens 8 to 48, stop strings on some."""
    longest = max(8, min(256, context - LONG - 16))
    prompts = list(PROMPTS)
    while len(prompts) < count:
        target = rng.randint(min(32, longest), longest)
        words = [rng.choice(WORDS).capitalize()]
        while len(tokenizer.encode(" ".join(words))) < target:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words))
    specs = []
    for i, prompt in enumerate(prompts[:count]):
        stop = ((".",), ("\n",), ())[i % 3] if i % 2 else ()
        specs.append(Spec(prompt, rng.choice([8, 16, 24, 32, 48]), stop))
    return specs


# --- Triton protocols ---------------------------------------------------------------------------


def triton_values(plan: Plan, stream: bool) -> dict[str, Any]:
    """The request's inputs (name -> value), with BAD_REQUESTS' change applied."""
    spec = plan.spec
    max_tokens = LONG if plan.kind == "cancel" else spec.max_tokens
    values: dict[str, Any] = {
        "text_input": spec.prompt,
        "max_tokens": max_tokens,
        "sampling_parameters": json.dumps(plan.sampling()),
        "stream": stream,
        # a non-streamed text starts with the prompt unless excluded
        "exclude_input_in_output": stream or not plan.echo,
    }
    if plan.bad == "missing_text_input":
        del values["text_input"]
    elif plan.bad == "max_tokens_0":
        values["max_tokens"] = 0
    elif plan.bad == "bad_sampling_json":
        values["sampling_parameters"] = '{"temperature": 0,'
    elif plan.bad == "deep_sampling_json":
        values["sampling_parameters"] = "[" * 100_000 + "]" * 100_000
    elif plan.bad == "huge_prompt":
        values["text_input"] = "a" * (MAX_PROMPT_BYTES + 1)
    return values


def grpc_tensors(values: dict[str, Any]) -> list[grpcclient.InferInput]:
    tensors = []
    for name, value in values.items():
        if isinstance(value, str):
            array, dtype = np.array([value.encode()], dtype=np.object_), "BYTES"
        elif isinstance(value, bool):
            array, dtype = np.array([value], dtype=np.bool_), "BOOL"
        else:
            array, dtype = np.array([value], dtype=np.int32), "INT32"
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def kserve_body(values: dict[str, Any]) -> dict[str, Any]:
    def datatype(value: Any) -> str:
        return "BYTES" if isinstance(value, str) else "BOOL" if isinstance(value, bool) else "INT32"

    inputs = [
        {"name": k, "shape": [1], "datatype": datatype(v), "data": [v]} for k, v in values.items()
    ]
    return {"inputs": inputs}


def grpc_error(e: InferenceServerException) -> Reply:
    status = str(e.status() or "")
    return Reply("error", code=status.removeprefix("StatusCode."), message=e.message() or str(e))


class GrpcClient:
    """One worker's gRPC client (one channel): unary infer on `llm` and one stream per request
    on `ensemble` (so that stop_stream(cancel_requests=True) cancels just that request)."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)

    def infer(self, plan: Plan, timeout: float) -> Reply:
        values = triton_values(plan, stream=False)
        deadline = plan.cancel_seconds if plan.kind == "cancel" else timeout
        try:
            result = self.client.infer("llm", grpc_tensors(values), client_timeout=deadline)
        except InferenceServerException as e:
            reply = grpc_error(e)
            if reply.code == "DEADLINE_EXCEEDED":
                reply.end = "cancelled" if plan.kind == "cancel" else "timeout"
            return reply
        return Reply("final", *_outputs(result))

    def stream(self, plan: Plan, stream: bool, timeout: float) -> Reply:
        values = triton_values(plan, stream=stream)
        state = _StreamState(plan.cancel_after if plan.kind == "cancel" else 0)
        self.client.start_stream(callback=state.on_response)
        cancel = True
        try:
            self.client.async_stream_infer(
                "ensemble", grpc_tensors(values), enable_empty_final_response=True
            )
            if plan.kind == "cancel":  # after cancel_after responses, or cancel_seconds
                reached = state.reached.wait(timeout if stream else plan.cancel_seconds)
                if not state.done.is_set():
                    return Reply("timeout" if stream and not reached else "cancelled")
            if not state.done.wait(timeout):
                return Reply("timeout")
            cancel = False
            return state.reply()
        finally:
            self.client.stop_stream(cancel_requests=cancel)

    def close(self) -> None:
        self.client.close()


def _outputs(result: Any) -> tuple[str, str]:
    def item(name: str) -> str:
        value = result.as_numpy(name)
        return "" if value is None else value.reshape(-1)[0].decode("utf-8", "replace")

    return item("text_output"), item("finish_reason")


class _StreamState:
    """The responses of one gRPC stream, collected by its callback thread."""

    def __init__(self, cancel_after: int) -> None:
        self.texts: list[str] = []
        self.indexes: list[int] = []
        self.finish_reason = ""
        self.error: InferenceServerException | None = None
        self.cancel_after = cancel_after
        self.done = threading.Event()
        self.reached = threading.Event()  # cancel_after responses have arrived, or the end

    def on_response(self, result: Any, error: Any) -> None:
        if self.done.is_set():
            return  # after the end: the cancel's own error
        if error is not None:
            self.error = error
            self._end()
            return
        if len(result.get_response().outputs):
            text, self.finish_reason = _outputs(result)
            self.texts.append(text)
            self.indexes.append(int(result.as_numpy("index").reshape(-1)[0]))
            if len(self.texts) == self.cancel_after:
                self.reached.set()
        if result.get_response().parameters["triton_final_response"].bool_param:
            self._end()

    def _end(self) -> None:
        self.done.set()
        self.reached.set()

    def reply(self) -> Reply:
        if self.error is not None:
            return grpc_error(self.error)
        if self.indexes != list(range(len(self.indexes))) or not self.finish_reason:
            return Reply("truncated", message=f"indexes {self.indexes[:20]}")
        return Reply("final", "".join(self.texts), self.finish_reason)


# --- HTTP ---------------------------------------------------------------------------------------


class Http:
    """Requests to one HTTP server, one connection each (closed to cancel or disconnect)."""

    def __init__(self, port: int) -> None:
        self.port = port

    @contextlib.contextmanager
    def post(
        self, path: str, body: bytes, timeout: float, content_type: str = JSON
    ) -> Iterator[tuple[http.client.HTTPConnection, socket.socket]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": content_type})
            assert conn.sock is not None
            yield conn, conn.sock
        finally:
            conn.close()

    def call(
        self, path: str, body: bytes, timeout: float, content_type: str = JSON, leave: float = 0
    ) -> Reply:
        """A non-streamed request; Reply.text holds the raw body of a 200. With `leave` > 0 the
        client hangs up if no answer has come within `leave` seconds (Reply end `cancelled`)."""
        try:
            with self.post(path, body, timeout, content_type) as (conn, sock):
                sock.settimeout(leave or timeout)
                try:
                    response = conn.getresponse()
                except TimeoutError:
                    if not leave:
                        raise
                    hang_up(sock)
                    return Reply("cancelled")
                sock.settimeout(timeout)
                raw = response.read().decode("utf-8", "replace")
        except TimeoutError:
            return Reply("timeout")
        except (http.client.HTTPException, OSError) as e:
            return Reply("truncated", message=f"{type(e).__name__}: {e}")
        if response.status != 200:
            return Reply("error", status=response.status, message=raw[:300])
        return Reply("final", raw, status=200)

    def events(
        self, path: str, body: bytes, timeout: float, cancel_after: int, content_type: str = JSON
    ) -> tuple[Reply, list[Any]]:
        """A server-sent-events request: its `data:` payloads (JSON, or "[DONE]"); closed after
        `cancel_after` of them when that is > 0 (Reply end `cancelled`)."""
        deadline = time.monotonic() + timeout
        events: list[Any] = []
        try:
            with self.post(path, body, timeout, content_type) as (conn, sock):
                response = conn.getresponse()
                if response.status != 200:
                    raw = response.read().decode("utf-8", "replace")
                    return Reply("error", status=response.status, message=raw[:300]), events
                while line := response.readline():
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
                        if len(events) == cancel_after:
                            hang_up(sock)
                            return Reply("cancelled"), events
                    if time.monotonic() > deadline:
                        return Reply("timeout"), events
        except TimeoutError:
            return Reply("timeout"), events
        except (http.client.HTTPException, OSError, ValueError) as e:
            return Reply("truncated", message=f"{type(e).__name__}: {e}"), events
        return Reply("final", status=200), events


def hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def triton_http(http: Http, plan: Plan, protocol: str, timeout: float) -> Reply:
    if protocol == "http_infer_llm":
        values = triton_values(plan, stream=False)
        reply = http.call("/v2/models/llm/infer", _json(kserve_body(values)), timeout)
        if reply.end == "final":
            outputs = {o["name"]: o["data"] for o in json.loads(reply.text)["outputs"]}
            reply.text, reply.finish_reason = outputs["text_output"][0], outputs["finish_reason"][0]
        return reply
    stream = protocol == "http_generate_stream"
    values = triton_values(plan, stream=stream)
    body = _json(values)
    if plan.bad == "deep_json_body":
        body = body[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = f"/v2/models/ensemble/{'generate_stream' if stream else 'generate'}"
    if not stream:
        leave = plan.cancel_seconds if plan.kind == "disconnect" else 0
        reply = http.call(path, body, timeout, leave=leave)
        if reply.end == "final":
            out = json.loads(reply.text)
            reply.text, reply.finish_reason = out["text_output"], out["finish_reason"]
        return reply
    reply, events = http.events(path, body, timeout, plan.cancel_after)
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        return Reply("error", status=200, message=str(errors[0])[:300])
    if reply.end == "final":
        indexes = [e["index"] for e in events]
        reason = events[-1]["finish_reason"] if events else ""
        if indexes != list(range(len(events))) or not reason:
            return Reply("truncated", message=f"indexes {indexes[:20]}, last reason {reason!r}")
        reply.text, reply.finish_reason = "".join(e["text_output"] for e in events), reason
    return reply


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


# --- the gateway --------------------------------------------------------------------------------


def gateway_body(plan: Plan, model: str, chat: bool, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": model, "stream": stream, **plan.sampling()}
    max_tokens = LONG if plan.kind == "cancel" else plan.spec.max_tokens
    if plan.bad == "max_tokens_0":
        max_tokens = 0
    prompt = plan.spec.prompt
    if plan.bad == "huge_prompt":
        prompt = "a" * (MAX_PROMPT_BYTES + 1)
    elif plan.bad == "lone_surrogate":
        prompt = "@@"  # replaced below by a JSON escape that UTF-8 cannot encode
    if chat:
        body.update(
            messages=[{"role": "user", "content": prompt}], max_completion_tokens=max_tokens
        )
    else:
        body.update(prompt=prompt, max_tokens=max_tokens)
    raw = _json(body)
    if plan.bad == "lone_surrogate":
        raw = raw.replace(b'"@@"', b'"hi \\ud800 there"')
    elif plan.bad == "deep_json_body":
        raw = raw[:-1] + b', "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    elif plan.bad == "bad_json_body":
        raw = raw[: len(raw) // 2]
    return raw


def gateway(http: Http, plan: Plan, protocol: str, model: str, timeout: float) -> Reply:
    chat = protocol.startswith("openai_chat")
    stream = protocol.endswith("_stream")
    body = gateway_body(plan, model, chat, stream)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content_type = "text/plain" if plan.bad == "text_plain" else JSON
    if not stream:
        leave = plan.cancel_seconds if plan.kind == "cancel" else 0
        reply = http.call(path, body, timeout, content_type, leave)
        if reply.end == "final":
            choice = json.loads(reply.text)["choices"][0]
            reply.text = choice["message"]["content"] if chat else choice["text"]
            reply.finish_reason = choice["finish_reason"] or ""
        return reply
    reply, events = http.events(path, body, timeout, plan.cancel_after, content_type)
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        return Reply("error", status=200, message=str(errors[0])[:300])
    if reply.end == "final":
        chunks = [e for e in events if isinstance(e, dict)]
        reason = chunks[-1]["choices"][0]["finish_reason"] if chunks else None
        if events[-1:] != ["[DONE]"] or not reason:
            return Reply("truncated", message=f"{len(events)} events, last reason {reason!r}")
        texts = [
            c["choices"][0]["delta"].get("content") or "" if chat else c["choices"][0]["text"]
            for c in chunks
        ]
        reply.text, reply.finish_reason = "".join(texts), reason
    return reply


# --- the mix ------------------------------------------------------------------------------------

# protocol: (weight of good requests, of cancels): a good request is greedy 3 times in 4;
# http_generate's cancels are disconnects (not cancelled upstream, see the module docstring)
MIX = {
    "http_generate": (10, 1),
    "http_generate_stream": (8, 3),
    "http_infer_llm": (8, 0),
    "grpc_infer_llm": (8, 3),
    "grpc_stream": (10, 3),
    "grpc_stream_nonstreamed": (6, 2),
    "openai_completions": (5, 1),
    "openai_completions_stream": (5, 2),
    "openai_chat": (5, 1),
    "openai_chat_stream": (5, 2),
}
BAD_WEIGHT = 12
STREAMED_OPENAI = ("openai_completions_stream", "openai_chat_stream")
# protocol: malformed requests, each refused with a 4xx, INVALID_ARGUMENT or a stream error
BAD_REQUESTS = {
    "http_generate": [
        "missing_text_input",
        "max_tokens_0",
        "bad_sampling_json",
        "deep_sampling_json",
        "deep_json_body",
        "huge_prompt",
    ],
    "http_generate_stream": ["max_tokens_0", "bad_sampling_json"],
    "http_infer_llm": ["missing_text_input", "max_tokens_0", "huge_prompt"],
    "grpc_infer_llm": ["missing_text_input", "max_tokens_0", "bad_sampling_json", "huge_prompt"],
    "grpc_stream": ["missing_text_input", "max_tokens_0", "deep_sampling_json", "huge_prompt"],
    "grpc_stream_nonstreamed": ["bad_sampling_json"],
    "openai_completions": ["lone_surrogate", "text_plain", "bad_json_body", "max_tokens_0"],
    "openai_completions_stream": ["huge_prompt"],
    "openai_chat": ["lone_surrogate", "deep_json_body"],
    "openai_chat_stream": ["text_plain"],
}
FAMILY = {  # the oracle family of each protocol's text
    "http_generate": "whole",
    "http_infer_llm": "whole",
    "grpc_infer_llm": "whole",
    "grpc_stream_nonstreamed": "whole",
    "http_generate_stream": "stream",
    "grpc_stream": "stream",
    "openai_completions": "stream",
    "openai_completions_stream": "stream",
    "openai_chat": "chat",
    "openai_chat_stream": "chat",
}


def pick(rng: random.Random, specs: list[Spec]) -> Plan:
    choices = [(p, "good") for p in MIX] + [(p, "cancel") for p in MIX] + [("", "bad")]
    weights = [g for g, _ in MIX.values()] + [c for _, c in MIX.values()] + [BAD_WEIGHT]
    protocol, kind = rng.choices(choices, weights)[0]
    spec = rng.choice(specs)
    if kind == "bad":
        protocol, bad = rng.choice([(p, b) for p, cases in BAD_REQUESTS.items() for b in cases])
        return Plan(protocol, kind, spec, bad=bad)
    if kind == "cancel" and protocol == "http_generate":
        kind = "disconnect"
    streamed = protocol in ("grpc_stream", "http_generate_stream", *STREAMED_OPENAI)
    return Plan(
        protocol,
        kind,
        spec,
        greedy=kind != "good" or rng.random() < 0.75,
        cancel_after=rng.randint(1, 8) if kind == "cancel" and streamed else 0,
        cancel_seconds=rng.uniform(0.2, 1.5),
        seed=rng.randrange(1 << 31),
        echo=rng.random() < 0.5,
    )


@dataclass
class Record:
    protocol: str
    kind: str
    bad: str
    outcome: str
    seconds: float
    detail: str = ""


class Soak:
    """The server, the gateway and the clients' shared state (records, oracle)."""

    def __init__(self, server: TritonServer, gateway_port: int, model: str, timeout: float):
        self.server = server
        self.triton_http = Http(server.http_port)
        self.gateway_http = Http(gateway_port)
        self.model = model
        self.timeout = timeout
        self.oracle: dict[tuple[str, Spec], str] = {}
        self.check_text = True  # False: differences are reported, not failures
        self.records: list[Record] = []
        self.in_flight: dict[int, tuple[Plan, float]] = {}  # by worker: its request, since
        self.lock = threading.Lock()

    def send(self, plan: Plan, grpc: GrpcClient) -> Reply:
        p = plan.protocol
        if p.startswith("openai"):
            return gateway(self.gateway_http, plan, p, self.model, self.timeout)
        if p == "grpc_infer_llm":
            return grpc.infer(plan, self.timeout)
        if p.startswith("grpc_stream"):
            return grpc.stream(plan, p == "grpc_stream", self.timeout)
        return triton_http(self.triton_http, plan, p, self.timeout)

    def run_one(self, plan: Plan, grpc: GrpcClient) -> Record:
        start = time.monotonic()
        try:
            reply = self.send(plan, grpc)
        except Exception as e:  # a broken answer (bad JSON, missing field): the server's fault
            reply = Reply("truncated", message=f"{type(e).__name__}: {e}")
        outcome, detail = self.classify(plan, reply)
        seconds = time.monotonic() - start
        record = Record(plan.protocol, plan.kind, plan.bad, outcome, seconds, detail)
        with self.lock:
            self.records.append(record)
        return record

    def classify(self, plan: Plan, reply: Reply) -> tuple[str, str]:
        """(outcome, detail): ok, wrong_text, cancelled, disconnected, rejected, busy, hung,
        lost, unexpected_5xx, unexpected_error."""
        what = f"{plan.protocol} {plan.kind} {plan.bad} {plan.spec.prompt[:40]!r}: "
        if reply.end == "timeout":
            return "hung", what + f"no end within {self.timeout} s"
        if reply.end == "truncated":
            return "lost", what + reply.message
        if reply.end == "cancelled":
            return ("disconnected" if plan.kind == "disconnect" else "cancelled"), ""
        if reply.end == "error":
            return self._error(plan, reply, what)
        if plan.kind == "bad":
            return "unexpected_error", what + "a bad request was answered 200"
        if reply.finish_reason not in ("length", "stop"):
            return "lost", what + f"finish_reason {reply.finish_reason!r}"
        expected = self.oracle.get((FAMILY[plan.protocol], plan.spec))
        if expected is not None and plan.echo and FAMILY[plan.protocol] == "whole":
            expected = plan.spec.prompt + expected
        checked = plan.greedy and plan.kind != "cancel"
        if checked and expected is not None and reply.text != expected:
            return "wrong_text", what + f"{reply.text[:80]!r} != {expected[:80]!r}"
        return "ok", ""

    def _error(self, plan: Plan, reply: Reply, what: str) -> tuple[str, str]:
        detail = what + f"{reply.status or reply.code or 'stream error'}: {reply.message[:200]}"
        server_fault = (reply.status or 0) >= 500 or reply.code in (
            "INTERNAL",
            "UNKNOWN",
            "UNAVAILABLE",
        )
        if "server busy" in reply.message or reply.status == 429:
            return "busy", detail
        if server_fault or "internal error" in reply.message.lower():
            return "unexpected_5xx", detail
        if plan.kind == "bad":
            return "rejected", ""
        return "unexpected_error", detail

    def make_oracle(self, specs: list[Spec]) -> None:
        """Each spec once per family, one request at a time (greedy)."""
        grpc = GrpcClient(self.server.grpc_url)
        try:
            for spec in specs:
                for family, protocol in (
                    ("whole", "http_generate"),
                    ("stream", "grpc_stream"),
                    ("chat", "openai_chat"),
                ):
                    reply = self.send(Plan(protocol, "good", spec), grpc)
                    if reply.end != "final":
                        raise RuntimeError(f"oracle request {protocol} {spec} failed: {reply}")
                    self.oracle[family, spec] = reply.text
        finally:
            grpc.close()

    def outcomes(self) -> Counter[str]:
        with self.lock:
            return Counter(r.outcome for r in self.records)

    def worker(self, seed: int, specs: list[Spec], stop: threading.Event) -> None:
        rng = random.Random(seed)
        grpc = GrpcClient(self.server.grpc_url)
        try:
            while not stop.is_set():
                plan = pick(rng, specs)
                self.in_flight[seed] = (plan, time.monotonic())
                self.run_one(plan, grpc)
                del self.in_flight[seed]
        finally:
            grpc.close()

    def stuck(self, seconds: float) -> list[Record]:
        """The requests in flight for longer than `seconds` (as `hung` records): a client
        blocked where no timeout reaches (e.g. tritonclient's stop_stream, which waits for
        the server to close the stream)."""
        now = time.monotonic()
        return [
            Record(plan.protocol, plan.kind, plan.bad, "hung", now - t, f"{plan}: still running")
            for plan, t in list(self.in_flight.values())
            if now - t > seconds
        ]


# --- processes ----------------------------------------------------------------------------------


def process_stats(pid: int) -> dict[str, Any] | None:
    """RSS (MiB), open file descriptors and threads of a live process (None once gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {
        "pid": pid,
        "rss_mib": round(rss_kib / 1024, 1),
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def stubs(server_pid: int) -> dict[str, int]:
    """The server's child processes (the Python backend stubs): instance name -> pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid:
            # the stub's argv: stub model.py shm-region sizes... parent-pid backend-dir N instance
            name = argv[8].decode() if len(argv) > 8 else f"child-{entry}"
            found[name] = int(entry)
    return found


def snapshot(server_pid: int, gateway_pid: int, requests: int, t0: float) -> dict[str, Any]:
    """Seconds since the load began, requests sent so far, and each process's stats: the server,
    its stubs (by instance name), the gateway, and `server_and_stubs` summed."""
    procs = {"tritonserver": process_stats(server_pid)}
    procs |= {name: process_stats(pid) for name, pid in sorted(stubs(server_pid).items())}
    alive = [p for p in procs.values() if p]
    procs["server_and_stubs"] = {
        "rss_mib": round(sum(p["rss_mib"] for p in alive), 1),
        "fds": sum(p["fds"] for p in alive),
        "threads": sum(p["threads"] for p in alive),
    }
    procs["gateway"] = process_stats(gateway_pid)
    return {"t_s": round(time.monotonic() - t0, 1), "requests": requests, "procs": procs}


def growth(samples: list[dict[str, Any]], midway: dict[str, Any]) -> dict[str, Any]:
    """Per process: RSS (MiB), fds and threads at the start, midway and the end of the soak,
    and the change per 1,000 requests over the whole soak and over its second half (the first
    requests also fill caches and allocator pools)."""
    first, last = samples[0], samples[-1]

    def per_1000(a: dict[str, Any], b: dict[str, Any], key: str, name: str) -> float | None:
        x, y = a["procs"].get(name), b["procs"].get(name)
        if not x or not y:
            return None
        return round((y[key] - x[key]) * 1000 / max(b["requests"] - a["requests"], 1), 2)

    out = {}
    for name, stats in first["procs"].items():
        ends = [s["procs"].get(name) or {} for s in (first, midway, last)]
        out[name] = {"pid": stats.get("pid")} if "pid" in stats else {}
        for key in ("rss_mib", "fds", "threads"):
            out[name][key] = [e.get(key) for e in ends]
        out[name]["rss_mib_per_1000_requests"] = per_1000(first, last, "rss_mib", name)
        out[name]["rss_mib_per_1000_requests_2nd_half"] = per_1000(midway, last, "rss_mib", name)
        out[name]["fds_per_1000_requests"] = per_1000(first, last, "fds", name)
    return out


# --- set-up -------------------------------------------------------------------------------------


def tiny_model(root: Path) -> Path:
    from conftest import make_checkpoint  # tests/conftest.py

    path = make_checkpoint(root / "tiny-llama", "llama")
    config = {"chat_template": TINY_CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@contextlib.contextmanager
def run_gateway(server: TritonServer, model_dir: Path, log_path: Path) -> Iterator[tuple[int, int]]:
    """`pagedllm openai` as a subprocess; (port, pid) once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "openai", "--triton-url", server.grpc_url]
    cmd += ["--port", str(port), "--model-dir", str(model_dir)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        yield port, proc.pid
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        proc.kill()


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Observed:
    """What a soak saw besides its requests."""

    specs: list[Spec]
    oracle_s: float
    load_s: float
    samples: list[dict[str, Any]]  # snapshot()s: at the start, every --sample-every s, the end
    before: dict[str, float]  # the engine's metrics when the load began
    after: dict[str, float]  # and once at rest (or after --idle-timeout)
    idle_s: float | None  # seconds to rest after the load; None: not within --idle-timeout
    stub_pids: tuple[dict[str, int], dict[str, int]]  # at the start and the end
    server_alive: bool  # the same tritonserver process ran throughout
    server_log: Path


def soak(args: argparse.Namespace, model_dir: Path, work: Path) -> tuple[Soak, Observed]:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    context = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    specs = make_specs(tokenizer, context, args.prompts, random.Random(args.seed))
    server = make_server(str(model_dir), dtype=args.dtype)
    log(f"starting tritonserver ({model_dir.name}, {args.dtype}); log {server.log_path}")
    with server, run_gateway(server, model_dir, work / "gateway.log") as (gateway_port, gw_pid):
        assert server.process is not None
        pid = server.process.pid
        state = Soak(server, gateway_port, model_dir.name, args.request_timeout)
        state.check_text = args.dtype == "float32"
        log(f"oracle: {len(specs)} prompts x 3 protocol families")
        t = time.monotonic()
        state.make_oracle(specs)
        oracle_s = time.monotonic() - t
        warm = GrpcClient(server.grpc_url)
        for protocol in FAMILY:  # every path once (lazy set-up along each), not counted
            state.send(Plan(protocol, "good", specs[0]), warm)
        warm.close()
        server_metrics.wait_idle(server.metrics_url, timeout=60)
        before = server_metrics.metrics(server.metrics_url)
        stubs_before = stubs(pid)
        t0 = time.monotonic()
        samples = [snapshot(pid, gw_pid, 0, t0)]
        log(f"load: {args.minutes} min, {args.concurrency} clients")
        stop = threading.Event()
        workers = [
            threading.Thread(
                target=state.worker, args=(args.seed * 1000 + i, specs, stop), daemon=True
            )
            for i in range(args.concurrency)
        ]
        for w in workers:
            w.start()
        end = t0 + args.minutes * 60
        while (now := time.monotonic()) < end and server.process.poll() is None:
            time.sleep(min(args.sample_every, end - now))
            samples.append(snapshot(pid, gw_pid, len(state.records), t0))
            rss = samples[-1]["procs"]["server_and_stubs"]["rss_mib"]
            log(f"{samples[-1]['t_s']:.0f} s, {rss} MiB: {dict(state.outcomes())}")
        stop.set()
        deadline = time.monotonic() + args.request_timeout + 30
        for w in workers:
            w.join(max(deadline - time.monotonic(), 0))
        state.records += state.stuck(args.request_timeout)  # their threads are left behind
        load_s = time.monotonic() - t0
        idle_s: float | None = None
        after: dict[str, float] = {}
        with contextlib.suppress(AssertionError, OSError):  # busy, or the server is gone
            idle_s = server_metrics.wait_idle(server.metrics_url, args.idle_timeout)
        with contextlib.suppress(OSError):
            after = server_metrics.metrics(server.metrics_url)
        time.sleep(1.0)  # connections the clients closed last are closed on the server too
        samples.append(snapshot(pid, gw_pid, len(state.records), t0))
        alive = server.process.poll() is None
        observed = Observed(
            specs,
            oracle_s,
            load_s,
            samples,
            before,
            after,
            idle_s,
            (stubs_before, stubs(pid)),
            alive,
            server.log_path,
        )
    return state, observed


def report(args: argparse.Namespace, state: Soak, seen: Observed) -> dict[str, Any]:
    outcomes = state.outcomes()
    finished = sum(seen.after.get(k, 0) - seen.before.get(k, 0) for k in FINISHED)
    sent = sum(outcomes[o] for o in ("ok", "wrong_text", "cancelled", "disconnected"))
    restarted = sorted(
        name
        for name in seen.stub_pids[0].keys() | seen.stub_pids[1].keys()
        if seen.stub_pids[0].get(name) != seen.stub_pids[1].get(name)
    )
    checks = {
        "hung": outcomes["hung"],
        "lost": outcomes["lost"],
        "wrong_text": outcomes["wrong_text"] if state.check_text else 0,
        "unexpected_5xx": outcomes["unexpected_5xx"],
        "unexpected_error": outcomes["unexpected_error"],
        "kv_not_at_rest": int(seen.idle_s is None),
        "engine_finished_minus_requests_sent": round(finished - sent),
        "server_restarted": int(not seen.server_alive),
        "stubs_restarted": len(restarted),
    }
    midway = min(seen.samples, key=lambda s: abs(s["t_s"] - seen.load_s / 2))
    return {
        "passed": not any(checks.values()),
        "checks": checks,
        "config": config_section(args, seen),
        "oracle": {
            "seconds": round(seen.oracle_s, 1),
            "whole_equals_stream": sum(
                state.oracle["whole", s] == state.oracle["stream", s] for s in seen.specs
            ),
            "text_check": "enforced" if state.check_text else f"not enforced ({args.dtype})",
        },
        "load_s": round(seen.load_s, 1),
        "requests": requests_section(state.records, seen.load_s),
        "engine": engine_section(seen, outcomes, finished, sent),
        "processes": {
            "server_pid_unchanged": seen.server_alive,
            "stub_pids": seen.stub_pids[1],
            "stubs_restarted": restarted,
            **growth(seen.samples, midway),
        },
        "samples": [
            [s["t_s"], s["requests"], s["procs"]["server_and_stubs"]["rss_mib"]]
            for s in seen.samples
        ],
        "failures": [asdict(r) for r in state.records if r.outcome in FAILURES][:30],
    }


FINISHED = [
    f"vllm:request_success_total{{finished_reason={r}}}" for r in ("stop", "length", "abort")
]
FAILURES = ("hung", "lost", "wrong_text", "unexpected_5xx", "unexpected_error")


def config_section(args: argparse.Namespace, seen: Observed) -> dict[str, Any]:
    return {
        "model": args.model_name,
        "dtype": args.dtype,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "request_timeout_s": args.request_timeout,
        "specs": [[s.prompt[:40], s.max_tokens, list(s.stop)] for s in seen.specs],
        "server_log": str(seen.server_log),
    }


def requests_section(records: list[Record], load_s: float) -> dict[str, Any]:
    by_protocol: dict[str, Counter[str]] = defaultdict(Counter)
    latency: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_protocol[r.protocol][r.outcome] += 1
        if r.outcome == "ok":
            latency[r.protocol].append(r.seconds)
    bad = Counter(f"{r.protocol} {r.bad}: {r.outcome}" for r in records if r.bad)
    return {
        "total": len(records),
        "per_s": round(len(records) / load_s, 2),
        "by_outcome": dict(sorted(Counter(r.outcome for r in records).items())),
        "by_protocol": {p: dict(sorted(c.items())) for p, c in sorted(by_protocol.items())},
        "bad_requests": dict(sorted(bad.items())),
        "latency_ms_ok_p50_p90_max": {
            p: [percentile_ms(v, q) for q in (50, 90, 100)] for p, v in sorted(latency.items())
        },
    }


def engine_section(
    seen: Observed, outcomes: Counter[str], finished: float, sent: int
) -> dict[str, Any]:
    def delta(name: str) -> float:
        return round(seen.after.get(name, 0.0) - seen.before.get(name, 0.0), 3)

    rest = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    counters = sorted(k for k in seen.after if "_total" in k and delta(k))
    return {
        "aborted": delta(ABORTED),
        "cancels": outcomes["cancelled"],
        "http_disconnects_not_cancelled": outcomes["disconnected"],
        "finished": round(finished),
        "requests_sent_that_reach_it": sent,
        "at_rest_within_s": None if seen.idle_s is None else round(seen.idle_s, 2),
        "at_rest": {k.removeprefix("vllm:"): seen.after.get(k) for k in rest},
        "counters": {k.removeprefix("vllm:"): delta(k) for k in counters},
    }


def percentile_ms(values: list[float], q: float) -> int:
    return round(float(np.percentile(values, q)) * 1000)


def dumps(value: Any, indent: int = 0, width: int = 100) -> str:
    """JSON with every object or array that fits in `width` columns on one line."""
    flat = json.dumps(value, ensure_ascii=False)
    if len(flat) + indent <= width or not isinstance(value, dict | list) or not value:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 2, width)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps(v, indent + 2, width) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama (quick run)")
    ap.add_argument("--dtype", default="float32", help="the text check needs float32")
    ap.add_argument("--concurrency", type=int, default=6, help="client threads")
    ap.add_argument("--prompts", type=int, default=8, help="prompt specs (oracle entries)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=180.0, help="seconds: else hung")
    ap.add_argument("--idle-timeout", type=float, default=10.0, help="seconds to be at rest")
    ap.add_argument("--sample-every", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--output", default=None, help="also write the JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = Path(tmp)
        if args.tiny:
            model_dir = tiny_model(work)
        elif args.model:
            model_dir = Path(args.model).resolve()
        else:
            from pagedllm.prepare import prepare_smollm2

            model_dir = prepare_smollm2()
        args.model_name = model_dir.name
        state, seen = soak(args, model_dir, work)
        result = report(args, state, seen)
        if not result["passed"]:
            result["gateway_log_tail"] = (work / "gateway.log").read_text(errors="replace")[-3000:]
    text = dumps(result)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
