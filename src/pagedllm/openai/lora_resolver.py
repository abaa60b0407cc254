"""vLLM's `lora_filesystem_resolver`: a request whose `model` names no loaded adapter loads
`<VLLM_PLUGIN_LORA_CACHE_DIR>/<model>` on first use (then it is served like any other).

As vLLM: on only with runtime updating allowed (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), the cache
folder set, and the resolver among `VLLM_PLUGINS` (or that variable unset: vLLM then loads
every installed plugin, and this one ships with it); a folder is taken only when its
`adapter_config.json` says `"peft_type": "LORA"` and names the served model as
`base_model_name_or_path`. Beyond vLLM: the name must be one plain folder name (no separators,
no `..`), so a request cannot reach outside the cache folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PLUGIN = "lora_filesystem_resolver"
CACHE_DIR_ENV = "VLLM_PLUGIN_LORA_CACHE_DIR"
PLUGINS_ENV = "VLLM_PLUGINS"


def cache_dir_from_env() -> str | None:
    """The resolver's folder where vLLM's environment turns it on, else None."""
    folder = os.environ.get(CACHE_DIR_ENV, "").strip()
    plugins = os.environ.get(PLUGINS_ENV)
    if plugins is not None and PLUGIN not in {p.strip() for p in plugins.split(",")}:
        return None
    return folder or None


def resolve(cache_dir: str, model: str, base_model: str) -> str | None:
    """The adapter folder for `model` under `cache_dir`, or None when there is none to take."""
    if not model or model in (".", "..") or "/" in model or "\\" in model or "\0" in model:
        return None
    folder = Path(cache_dir) / model
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        return None
    return str(folder) if config.get("base_model_name_or_path") == base_model else None
