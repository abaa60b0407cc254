"""Which device an engine runs on: "auto", "cpu", "cuda" or "cuda:N", checked and resolved
once, before anything uses it."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

from pagedllm.errors import ConfigError

logger = logging.getLogger(__name__)

DEVICES = "auto, cpu, cuda, cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
RESOLVED = re.compile(r"cpu|cuda:\d+")


def check_device(device: str) -> str:
    """`device` in canonical spelling (lower case, no blanks); ConfigError unless it is one of
    DEVICES. Says nothing of whether the device exists (`resolve_device` does)."""
    name = device.strip().lower()
    if not _DEVICE.fullmatch(name):
        raise ConfigError(f"unsupported device {device!r}; use one of {DEVICES}")
    return name


def torch_is_cpu_only() -> bool:
    """Whether the installed torch is a CPU-only build (then "auto" is the CPU), read from its
    `version.py` without importing torch: 2-3 s of CPU and ~150 MB, which `pagedllm serve`
    (the supervisor of tritonserver, not its engine) would hold for as long as it serves."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True
    path = Path(spec.origin).parent / "version.py"
    build: dict[str, object] = {}
    exec(compile(path.read_text("utf-8"), str(path), "exec"), build)  # a few assignments
    return build.get("cuda") is None and build.get("hip") is None  # ROCm: GPUs as "cuda"


def resolve_device(device: str) -> str:
    """The torch device an engine runs on, "cpu" or "cuda:N", decided once before anything uses
    it and logged with the reason: "auto" takes the current CUDA device when torch sees one,
    else the CPU; "cuda" is the current CUDA device. A CUDA device that is not there is a
    ConfigError, not a torch traceback."""
    import torch  # here: the serving modules that only check a spelling need no torch

    name = check_device(device)
    if name == "cpu":
        logger.info("device cpu")
        return name
    if not torch.cuda.is_available():
        if name == "auto":
            logger.info("device auto -> cpu (no CUDA device)")
            return "cpu"
        build = "a CPU-only torch build" if torch.version.cuda is None else "no GPU or driver"
        raise ConfigError(
            f"device {name!r} asks for a GPU, but torch sees no CUDA device ({build}); "
            "use device 'auto' or 'cpu'"
        )
    index = int(name[5:]) if name.startswith("cuda:") else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(
            f"device {name!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    resolved = f"cuda:{index}"
    arrow = "" if name == resolved else f" -> {resolved}"
    logger.info("device %s%s (%s)", name, arrow, torch.cuda.get_device_name(index))
    return resolved
