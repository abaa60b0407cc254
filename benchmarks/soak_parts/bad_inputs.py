"""The soak's malformed requests: which protocol gets which, and each as a change to the good
request's Triton inputs or JSON body. Every one must be refused with a 4xx, gRPC
INVALID_ARGUMENT or an error on the stream."""

from __future__ import annotations

import json
import os
from typing import Any

# the tokenizer's and llm's max_prompt_bytes (docs/serving.md); the launcher passes the
# environment on, so PAGEDLLM_MAX_PROMPT_BYTES changes both
MAX_PROMPT_BYTES = int(os.environ.get("PAGEDLLM_MAX_PROMPT_BYTES") or 1 << 20)
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
JSON = "application/json"


def huge_prompt() -> str:
    """A prompt one byte over max_prompt_bytes."""
    return "a" * (MAX_PROMPT_BYTES + 1)


def deep_json_body(body: bytes, depth: int) -> bytes:
    """`body` (a JSON object) with one more field, arrays nested `depth` deep."""
    return body[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"


def spoil_triton_values(values: dict[str, Any], bad: str) -> None:
    """Apply `bad` to a request's Triton inputs (name -> value), in place."""
    if bad == "missing_text_input":
        del values["text_input"]
    elif bad == "max_tokens_0":
        values["max_tokens"] = 0
    elif bad == "bad_sampling_json":
        values["sampling_parameters"] = '{"temperature": 0,'
    elif bad == "deep_sampling_json":
        values["sampling_parameters"] = "[" * 100_000 + "]" * 100_000
    elif bad == "huge_prompt":
        values["text_input"] = huge_prompt()


def triton_body(values: dict[str, Any], bad: str) -> bytes:
    """The JSON body of Triton's generate endpoints, with `bad` applied."""
    body = json.dumps(values).encode()
    return deep_json_body(body, 100_000) if bad == "deep_json_body" else body


def gateway_json(body: dict[str, Any], bad: str, chat: bool) -> bytes:
    """The gateway's JSON body from its good fields (`prompt` or `messages`, `max_tokens` or
    `max_completion_tokens`), with `bad` applied."""
    length = "max_completion_tokens" if chat else "max_tokens"
    if bad == "max_tokens_0":
        body[length] = 0
    prompt = huge_prompt() if bad == "huge_prompt" else "@@" if bad == "lone_surrogate" else None
    if prompt is not None:  # "@@": replaced below by a JSON escape that UTF-8 cannot encode
        if chat:
            body["messages"][0]["content"] = prompt
        else:
            body["prompt"] = prompt
    raw = json.dumps(body).encode()
    if bad == "lone_surrogate":
        raw = raw.replace(b'"@@"', b'"hi \\ud800 there"')
    elif bad == "deep_json_body":
        raw = deep_json_body(raw, 10_000)
    elif bad == "bad_json_body":
        raw = raw[: len(raw) // 2]
    return raw


def content_type(bad: str) -> str:
    return "text/plain" if bad == "text_plain" else JSON
