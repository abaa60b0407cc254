"""LoRA adapters on the Triton `llm_engine` model, as vllm_backend configures and names them
(docs/lora.md): `enable_lora`, `max_loras`, `max_lora_rank` (and `max_cpu_loras`) among its
settings (read by `settings.lora_config`); the adapters, a name -> PEFT folder map, from
`lora_modules` (JSON, what `pagedllm serve --lora-modules` sets) and from a `multi_lora.json`
beside the model's `model.py`; a request names its adapter with `lora_name` in
`sampling_parameters` or in the request's parameters, and gets vllm_backend's errors for an
unknown name or LoRA off."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagedllm.lora.request import LoRARequest
from pagedllm.serving.codec import RequestError
from pagedllm.serving.settings import setting

MULTI_LORA_FILE = "multi_lora.json"


def _name_map(text: str, source: str) -> dict[str, str]:
    try:
        obj = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in obj.items()
    ):
        raise ValueError(f"{source} must be a JSON object of adapter name -> folder path")
    return obj


def lora_modules(parameters: dict[str, str], version_dir: str | None = None) -> dict[str, str]:
    """The adapters, name -> folder: `multi_lora.json` in `version_dir` (relative paths are
    read from there), then the `lora_modules` setting (JSON) over it."""
    modules: dict[str, str] = {}
    if version_dir is not None and (path := Path(version_dir) / MULTI_LORA_FILE).is_file():
        for name, folder in _name_map(path.read_text(), str(path)).items():
            modules[name] = str((path.parent / folder).resolve())
    modules.update(_name_map(setting(parameters, "lora_modules"), "lora_modules"))
    return modules


class LoRANames:
    """The served adapters by name, each a `LoRARequest` with an id of its own (1, 2, ... in
    the order given); `resolve` turns a request's `lora_name` into one."""

    def __init__(self, enabled: bool, modules: Mapping[str, str]) -> None:
        if modules and not enabled:
            raise ValueError("LoRA adapters are listed (lora_modules) but enable_lora is off")
        self.enabled = enabled
        self.requests = {
            name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(modules.items())
        }
        self._ids = itertools.count(len(self.requests) + 1)

    def new_id(self) -> int:
        """An adapter id never given before, by this or by the TensorRT-LLM task cache
        (serving/lora_tasks.py, which takes its ids here): the host cache, the slots and the
        prefix cache key on ids."""
        return next(self._ids)

    def add(self, name: str, path: str) -> LoRARequest:
        """A runtime load (`serving.lora_admin`): `name` -> `path` under a new id."""
        request = LoRARequest(name, self.new_id(), path)
        self.requests[name] = request
        return request

    def remove(self, name: str) -> None:
        """New requests can no longer name it; those in flight finish on it."""
        del self.requests[name]

    def resolve(self, name: Any) -> LoRARequest | None:
        """None for no name (the base model); vllm_backend's error for LoRA off or an
        unknown name."""
        if name is None:
            return None
        if not self.enabled:
            raise RequestError("LoRA feature is not enabled.")
        if not isinstance(name, str) or name not in self.requests:
            raise RequestError(
                f"LoRA {name} is not supported, we currently support {list(self.requests)}"
            )
        return self.requests[name]


def add_serve_arguments(parser: Any) -> None:
    """`pagedllm serve`'s LoRA flags, vLLM's spellings."""
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (docs/lora.md)"
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="the adapters, each a PEFT folder under the name requests give it",
    )
    parser.add_argument("--max-loras", type=int, default=None, help="adapters on the device")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="the largest rank")


def serve_env(args: Any) -> dict[str, str]:
    """The PAGEDLLM_* settings `pagedllm serve`'s LoRA flags stand for (ValueError if wrong)."""
    modules: dict[str, str] = {}
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
        modules[name] = str(Path(path).resolve())
    if not args.enable_lora:
        if modules or args.max_loras is not None or args.max_lora_rank is not None:
            raise ValueError("--lora-modules, --max-loras and --max-lora-rank need --enable-lora")
        return {}
    env = {"PAGEDLLM_ENABLE_LORA": "true", "PAGEDLLM_LORA_MODULES": json.dumps(modules)}
    if args.max_loras is not None:
        env["PAGEDLLM_MAX_LORAS"] = str(args.max_loras)
    if args.max_lora_rank is not None:
        env["PAGEDLLM_MAX_LORA_RANK"] = str(args.max_lora_rank)
    return env
