"""`POST /v1/embeddings` (OpenAI's, with vLLM's extras) over a server with the pooling runner.

Each input becomes one unary request to Triton's `llm` model carrying vllm_backend's
`embedding_request` JSON; they run concurrently and the engine batches them. `input`: a
string, a list of strings, a list of token ids or a list of such lists; `encoding_format`
"float" or "base64" (little-endian float32, as OpenAI's); `dimensions` (Matryoshka models
only, else 400); vLLM's `truncate_prompt_tokens` and `normalize`. Empty and over-long inputs
answer 400 with the engine's message.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcclient
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from tritonclient.utils import InferenceServerException

from pagedllm.openai.errors import APIError, bad_request, from_triton
from pagedllm.openai.request_body import read_json
from pagedllm.openai.triton import TritonError, request_error

# the Triton model that answers one embedding request (non-decoupled, vllm_backend's contract)
EMBEDDING_MODEL = "llm"
# inputs one request may embed
MAX_INPUTS = 2048
_KNOWN = {
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "truncate_prompt_tokens",
    "normalize",
}


def parse_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's `input` forms as a list of prompts; 400 for anything else or nothing."""

    def ids(x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x
        )

    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif ids(value) and value:
        prompts = [value]
    elif isinstance(value, list) and all(isinstance(x, str) or ids(x) for x in value):
        prompts = value
    else:
        raise bad_request(
            "input must be a string, a list of strings, a list of token ids or a list of them",
            "input",
        )
    if not prompts:
        raise bad_request("input is empty: nothing to embed", "input")
    if len(prompts) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request", "input")
    return prompts


def pooling_params(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("dimensions", "truncate_prompt_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_request(f"{name} must be an integer", name)
        out[name] = value
    if body.get("normalize") is not None:
        if not isinstance(body["normalize"], bool):
            raise bad_request("normalize must be a boolean", "normalize")
        out["normalize"] = body["normalize"]
    return out


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


class Embeddings:
    """The route's state: Triton's gRPC client (`client()`), the model-name check."""

    def __init__(
        self,
        client: Callable[[], grpcclient.InferenceServerClient],
        model_name: str,
        check_model: Callable[[str], None],
        max_body_bytes: int,
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.check_model = check_model
        self.max_body_bytes = max_body_bytes

    async def create(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        unknown = sorted(set(body) - _KNOWN)
        if unknown:
            raise bad_request(f"unknown fields {unknown}", unknown[0])
        if not isinstance(body.get("model"), str):
            raise bad_request("model is required", "model")
        self.check_model(body["model"])
        prompts = parse_inputs(body.get("input"))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
        params = pooling_params(body)
        try:
            results = await asyncio.gather(*(self._embed(p, params) for p in prompts))
        except TritonError as e:
            raise from_triton(e, "input") from None
        data = [
            {"object": "embedding", "index": i, "embedding": encode(vector, fmt)}
            for i, (vector, _) in enumerate(results)
        ]
        tokens = sum(n for _, n in results)
        return JSONResponse(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model_name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def _embed(self, prompt: str | list[int], params: dict[str, Any]) -> tuple[Any, int]:
        """One input's vector and token count from Triton; TritonError when refused."""
        raw = json.dumps({"input": prompt, "pooling_params": params}).encode()
        request = grpcclient.InferInput("embedding_request", [1], "BYTES")
        request.set_data_from_numpy(np.array([raw], dtype=np.object_))
        flag = grpcclient.InferInput("return_num_input_tokens", [1], "BOOL")
        flag.set_data_from_numpy(np.array([True]))
        outputs = [grpcclient.InferRequestedOutput(n) for n in ("embedding", "num_input_tokens")]
        try:
            result = await self.client().infer(EMBEDDING_MODEL, [request, flag], outputs=outputs)
        except InferenceServerException as e:
            # busy: 429; unreachable or not serving: 503 (`request_error`); a fault: 500
            if "INTERNAL" in str(e.status() or ""):
                raise TritonError(500, e.message() or "internal error") from None
            raise request_error(e.message() or "the request failed") from None
        vector = result.as_numpy("embedding")
        count = result.as_numpy("num_input_tokens")
        if vector is None or count is None:
            raise APIError(502, "Triton's answer has no embedding")
        return vector.reshape(-1), int(count.reshape(-1)[0])
