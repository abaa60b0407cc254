"""LoRA adapters on the gateway, vLLM's way (docs/lora.md, docs/openai.md).

- `model` = an adapter's name routes a completion or chat request to it (`lora_name` in the
  sampling parameters the engine reads) and is echoed back; any other name than the base
  model's or a served adapter's is vLLM's 404, "The model `x` does not exist.".
- `/v1/models` lists the base model, then every adapter with the base as `parent`.
- vLLM's filesystem resolver (openai/lora_resolver.py): an unknown name found in
  `VLLM_PLUGIN_LORA_CACHE_DIR` is loaded on first use.
- `/v1/load_lora_adapter` {lora_name, lora_path} and `/v1/unload_lora_adapter` {lora_name}
  exist only where `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is true (vLLM's opt-in; elsewhere 404),
  with vLLM's answers: a plain-text "Success: ..." or its errors.

The engine holds the list: every question goes to `llm_engine` as a `lora_admin` request
(`serving.lora_admin`), asked when a request names a model other than the base one, so that
every gateway in front of one server sees the same adapters.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from tritonclient.utils import InferenceServerException

from pagedllm.openai import lora_resolver
from pagedllm.openai.errors import APIError
from pagedllm.openai.models import ENGINE_MODEL, ServedModel
from pagedllm.openai.request_body import read_json
from pagedllm.openai.triton import TritonError, request_error

_TYPES = {400: "BadRequestError", 404: "NotFoundError"}


def not_found(model: str) -> APIError:
    """vLLM's answer to a model this server does not serve."""
    message = f"The model `{model}` does not exist."
    return APIError(404, message, param="model", type="NotFoundError", code=404)


def _error(status: int, message: str, type: str | None = None) -> APIError:
    return APIError(status, message, type=type or _TYPES.get(status), code=status)


async def ask_engine(client: grpcclient.InferenceServerClient, request: dict[str, Any]) -> Any:
    """`llm_engine`'s answer to one `lora_admin` request (a JSON object); TritonError when
    Triton cannot be asked or answers an error."""
    tensor = grpcclient.InferInput("lora_admin", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([json.dumps(request).encode()], dtype=np.object_))
    answered = asyncio.Event()  # the request stream stays open until the answer

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": ENGINE_MODEL, "inputs": [tensor]}
        await answered.wait()

    call = client.stream_infer(requests())
    try:
        async for result, error in call:
            if error is not None:
                raise request_error(str(error.message()))
            value = result.as_numpy("text_output")
            return json.loads(value.reshape(-1)[0]) if value is not None else None
    except (grpc.RpcError, InferenceServerException) as e:
        raise TritonError(503, f"{ENGINE_MODEL} cannot be asked about LoRA adapters: {e}") from e
    finally:
        answered.set()
        call.cancel()
    raise TritonError(502, f"{ENGINE_MODEL} did not answer a LoRA question")


class LoRAModels:
    """The served models as the routes see them: the base (`base`) and the engine's adapters;
    `allow_updates`: the load and unload routes exist."""

    def __init__(
        self,
        client: Callable[[], grpcclient.InferenceServerClient],
        base: ServedModel,
        allow_updates: bool,
        max_body_bytes: int,
        cache_dir: str | None = None,
    ) -> None:
        self.client, self.base = client, base
        self.allow_updates = allow_updates
        self.max_body_bytes = max_body_bytes
        # vLLM's filesystem resolver's folder (only with runtime updating allowed)
        self.cache_dir = cache_dir if allow_updates else None

    async def _ask(self, request: dict[str, Any]) -> list[tuple[str, str]]:
        """The adapters (name, folder) after `request`; APIError with the engine's refusal."""
        try:
            answer = await ask_engine(self.client(), request)
        except TritonError as e:
            raise _error(e.status, e.message) from None
        if not isinstance(answer, dict) or not ("adapters" in answer or "error" in answer):
            raise _error(502, f"{ENGINE_MODEL} answered a LoRA question with {answer!r}")
        if "error" in answer:
            raise _error(int(answer.get("status", 400)), str(answer["error"]))
        return [(str(name), str(path)) for name, path in answer["adapters"]]

    async def adapters(self) -> list[tuple[str, str]]:
        try:
            return await self._ask({"action": "list"})
        except APIError as e:
            if e.status != 400:
                raise
            return []  # an engine that takes no such question (the pooling runner's) has none

    async def resolve(self, model: str) -> dict[str, str]:
        """The sampling parameters that send a request to `model`: {} for the base model,
        `lora_name` for an adapter; 404 for anything else."""
        if model == self.base.name:
            return {}
        if any(name == model for name, _ in await self.adapters()):
            return {"lora_name": model}
        folder = self.cache_dir and lora_resolver.resolve(self.cache_dir, model, self.base.name)
        if not folder:
            raise not_found(model)
        try:
            await self._ask({"action": "load", "lora_name": model, "lora_path": folder})
        except APIError:  # a request beside this one may have loaded it first
            if not any(name == model for name, _ in await self.adapters()):
                raise
        return {"lora_name": model}

    async def cards(self) -> list[dict[str, Any]]:
        """`/v1/models`: the base model's card, then each adapter's."""
        adapters = [self.base.adapter_card(name, path) for name, path in await self.adapters()]
        return [await self.base.card(), *adapters]

    async def card(self, model: str) -> dict[str, Any]:
        for card in await self.cards():
            if card["id"] == model:
                return card
        raise not_found(model)

    # --- vLLM's runtime routes ----------------------------------------------------------

    def routes(self) -> list[Route]:
        if not self.allow_updates:
            return []
        return [
            Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
        ]

    async def load(self, request: Request) -> Response:
        body = await self._body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            message = "Both 'lora_name' and 'lora_path' must be provided."
            raise _error(400, message, "InvalidUserInput")
        if name == self.base.name or any(n == name for n, _ in await self.adapters()):
            message = f"The lora adapter '{name}' has already been loaded."
            raise _error(400, message, "InvalidUserInput")
        await self._ask({"action": "load", "lora_name": name, "lora_path": path})
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        name = (await self._body(request)).get("lora_name")
        if not (isinstance(name, str) and name):
            message = "either 'lora_name' and 'lora_int_id' needs to be provided."
            raise _error(400, message, "InvalidUserInput")
        await self._ask({"action": "unload", "lora_name": name})
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _body(self, request: Request) -> dict[str, Any]:
        body = await read_json(request, self.max_body_bytes)
        if not isinstance(body, dict):
            raise _error(400, "the request body must be a JSON object", "InvalidUserInput")
        return body

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self.cards()})

    async def get_model(self, request: Request) -> Response:
        return JSONResponse(await self.card(request.path_params["model"]))
