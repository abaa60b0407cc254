"""Adapters loaded and unloaded while the server runs: what the OpenAI gateway's vLLM routes
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/v1/models`) ask the `llm_engine` model
(docs/lora.md, Runtime loading).

A request to `llm_engine` with the `lora_admin` input (a JSON object) is one of
`{"action": "list"}`, `{"action": "load", "lora_name": ..., "lora_path": ...}` or
`{"action": "unload", "lora_name": ...}`; its one response's `text_output` is a JSON object:
`{"adapters": [[name, path], ...]}` (every adapter served, in the order they came), or
`{"error": message, "status": 400 | 404}`. Loads and unloads are refused unless this process
(tritonserver's) has vLLM's opt-in, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`: whoever reaches
Triton's port could otherwise make the engine read any folder of the server's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.lora.adapter import load_adapter
from pagedllm.lora.request import RUNTIME_LORA_ENV, LoRARequest, runtime_updating_allowed
from pagedllm.lora.slots import LoraSlots
from pagedllm.serving.lora import LoRANames

# reads and checks an adapter (LoRAError, a ValueError, naming what is wrong)
Check = Callable[[LoRARequest], Any]


def adapter_check(slots: LoraSlots | None) -> Check | None:
    """How a load is checked on an engine whose pool is `slots` (None: LoRA off): the folder
    read on the caller's thread, not into the host cache the engine thread uses."""
    if slots is None:
        return None
    return lambda request: load_adapter(request, slots.cfg, slots.config.max_lora_rank)


class _Refused(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def respond(names: LoRANames, value: np.ndarray, check: Check | None) -> dict[str, np.ndarray]:
    """The response's tensors to a `lora_admin` input `value` (one BYTES element)."""
    item = value.reshape(-1)[0] if value.size == 1 else b"null"
    text = item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
    answer = handle(names, text, check).encode()
    return {"text_output": np.array([answer], dtype=np.object_)}


def handle(names: LoRANames, text: str, check: Check | None) -> str:
    """One `lora_admin` request's answer (JSON); `check`: None when LoRA is off."""
    try:
        request = json.loads(text)
        if not isinstance(request, dict):
            raise _Refused("lora_admin must be a JSON object")
        _apply(names, request, check)
    except json.JSONDecodeError as e:
        return json.dumps({"error": f"lora_admin is not valid JSON: {e}", "status": 400})
    except _Refused as e:
        return json.dumps({"error": e.message, "status": e.status})
    adapters = [[name, r.lora_path] for name, r in names.requests.items()]
    return json.dumps({"adapters": adapters})


def _apply(names: LoRANames, request: dict[str, Any], check: Check | None) -> None:
    action = request.get("action")
    if action == "list":
        return
    if action not in ("load", "unload"):
        raise _Refused(f"lora_admin: unknown action {action!r} (list, load or unload)")
    if not runtime_updating_allowed():
        raise _Refused(f"runtime LoRA updating is off on this server ({RUNTIME_LORA_ENV})")
    if check is None or not names.enabled:
        raise _Refused("LoRA feature is not enabled.")
    name = _text(request, "lora_name")
    if action == "unload":
        if name not in names.requests:
            raise _Refused(f"The lora adapter '{name}' cannot be found.", 404)
        names.remove(name)
        return
    path = _text(request, "lora_path")
    if name in names.requests:
        raise _Refused(f"The lora adapter '{name}' has already been loaded.")
    if not Path(path).is_dir():  # vLLM's words, its 404
        raise _Refused(f"Loading lora {name} failed: No adapter found for {path}", 404)
    try:  # read and checked now (files, rank, targets; any id), again when first used
        check(LoRARequest(name, 1, path))
    except ValueError as e:
        raise _Refused(f"Loading lora {name} failed: {e}") from None
    names.add(name, path)


def _text(request: dict[str, Any], key: str) -> str:
    value = request.get(key)
    if not isinstance(value, str) or not value:
        raise _Refused(f"lora_admin: {key} must be a non-empty string")
    return value
