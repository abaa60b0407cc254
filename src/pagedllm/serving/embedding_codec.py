"""The Triton side of embeddings (`runner: pooling`, docs/embeddings.md): the requests and
responses, without torch (the `llm` model's stub imports this; `embedding_model` runs them).

`llm_engine` then hosts a `PoolingEngine` (`serving.embedding_model`): it takes vllm_backend's
`embedding_request` input — one JSON object, `{"input": text | token ids, "pooling_params":
{"dimensions", "normalize", "truncate_prompt_tokens"}}` — and answers one response: the
embedding as JSON in `text_output` (vllm_backend's), as an FP32 `embedding` tensor (ours),
`num_input_tokens` and `num_output_tokens` (0). Requests queue to one thread that runs all the
queued ones together (up to `max_num_seqs` / the token budget per forward pass).

The `llm` model (`llm_embedding_request` / `llm_embedding_outputs`) forwards vllm_backend's
request as it is, or turns a typed one (`text_input` or `input_ids`) into it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pagedllm.convert import to_bool
from pagedllm.pooling.params import PoolingParams
from pagedllm.serving.codec import RequestError
from pagedllm.serving.inputs import Getter

NOT_POOLING = (
    "this server runs the pooling runner (runner: pooling): it answers embedding requests only "
    "(an embedding_request, or the OpenAI embeddings endpoint)"
)
POOLING_KEYS = ("dimensions", "normalize", "truncate_prompt_tokens")


def pooling_params(raw: Any) -> PoolingParams:
    """vllm_backend's `pooling_params` object (it sends `dimensions` as a one-item list;
    numbers and booleans may come as strings)."""
    if raw is None:
        return PoolingParams()
    if not isinstance(raw, dict):
        raise RequestError("pooling_params must be a JSON object")
    unknown = sorted(set(raw) - set(POOLING_KEYS))
    if unknown:
        raise RequestError(f"unknown pooling_params {unknown}: known are {list(POOLING_KEYS)}")

    def number(name: str) -> int | None:
        value = raw.get(name)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise RequestError(f"pooling_params.{name} must be an integer") from None

    normalize = raw.get("normalize")
    try:
        return PoolingParams(
            dimensions=number("dimensions"),
            normalize=None if normalize is None else to_bool("normalize", normalize),
            truncate_prompt_tokens=number("truncate_prompt_tokens"),
        )
    except ValueError as e:
        raise RequestError(str(e)) from None


def parse_embedding_request(raw: bytes | str) -> tuple[str | list[int], PoolingParams]:
    """One `embedding_request` JSON -> (prompt, params); RequestError when malformed."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"embedding_request is not JSON: {e}") from None
    if not isinstance(body, dict) or "input" not in body:
        raise RequestError('embedding_request must be a JSON object with "input"')
    prompt = body["input"]
    ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )
    if not (isinstance(prompt, str) or ids):
        raise RequestError("embedding_request input must be one text or one list of token ids")
    return prompt, pooling_params(body.get("pooling_params"))


def embedding_response(vector: np.ndarray, num_input_tokens: int) -> dict[str, np.ndarray]:
    text = json.dumps(vector.tolist())
    return {
        "text_output": np.array([text.encode()], dtype=np.object_),
        "embedding": vector.astype(np.float32),
        "num_input_tokens": np.array([num_input_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([0], dtype=np.uint32),
    }


def llm_embedding_request(get: Getter) -> np.ndarray:
    """The `llm` model's request as llm_engine's `embedding_request`: vllm_backend's as it is,
    or a typed one (`text_input`, else `input_ids`)."""
    raw = get("embedding_request")
    if raw is not None:
        return np.asarray(raw, dtype=np.object_).reshape(1)
    text, ids = get("text_input"), get("input_ids")
    if text is not None:
        value = np.asarray(text).reshape(-1)[0]
        prompt: str | list[int] = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    elif ids is not None:
        prompt = [int(t) for t in np.asarray(ids).reshape(-1)]
    else:
        raise RequestError("an embedding request needs embedding_request, text_input or input_ids")
    return np.array([json.dumps({"input": prompt}).encode()], dtype=np.object_)


def llm_embedding_outputs(get: Getter, engine: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The `llm` model's response: `text_output` (vllm_backend's JSON) and `embedding`, plus
    the token counts its `return_num_*_tokens` flags ask for."""
    out = {"text_output": engine["text_output"], "embedding": engine["embedding"]}
    for flag, name in (
        ("return_num_input_tokens", "num_input_tokens"),
        ("return_num_output_tokens", "num_output_tokens"),
    ):
        value = get(flag)
        if value is not None and bool(np.asarray(value).reshape(-1)[0]):
            out[name] = engine[name]
    return out
