"""Every Triton kernel of the package compiled for real GPUs, with no GPU present.

The kernels are launched through the project's own launchers (the attention backend's
`forward` over the metadata it builds, the graph runner's fixed-split decode metadata, the
bitmask launcher) with CPU tensors, under a stand-in driver that answers the GPU target. A
`jit_cache_hook` records what each launch would compile (Triton's own specialization data:
signature, constexprs, alignment attributes, options) and skips the launch. The recorded
launches are then compiled (`JITFunction.preload`) in a process pool, for each architecture,
with the `triton` wheel's own `ptxas`; its `-v` report gives registers and spills.

Must run in a process without `TRITON_INTERPRET` (the interpreter replaces `@triton.jit`
functions when they are defined): `scripts/kernel_report.py` is the command, and
`tests/test_kernels_compile.py` runs it. See docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pkgutil
import re
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.layers.all_workloads import workloads


@dataclass(frozen=True)
class Arch:
    """The per-SM and per-block limits of one architecture (CUDA programming guide, compute
    capabilities table)."""

    name: str
    smem_per_block: int  # opt-in maximum of dynamic shared memory per block, bytes
    smem_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    regs_per_sm: int = 65536


ARCHS = {
    80: Arch("A100", 166912, 167936, 64, 32),
    89: Arch("L4/L40S", 101376, 102400, 48, 24),
    90: Arch("H100/H200", 232448, 233472, 64, 32),
    100: Arch("B200", 232448, 233472, 64, 32),
}


# --- discovery --------------------------------------------------------------------------------


def discover_kernels() -> dict[str, Any]:
    """Every `@triton.jit` function defined in the package, by `module:name` (modules whose
    source holds `@triton.jit`, so a new kernel file is found without being listed)."""
    from triton.runtime.jit import JITFunction

    kernels: dict[str, Any] = {}
    root = Path(__file__).resolve().parents[1]  # the pagedllm package
    for info in pkgutil.walk_packages([str(root)], "pagedllm."):
        path = root.joinpath(*info.name.split(".")[1:])
        source = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
        if not source.is_file() or "@triton.jit" not in source.read_text():
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == info.name:
                kernels[f"{info.name}:{name}"] = obj
    return kernels


# --- recording the launches -------------------------------------------------------------------


class StandInDriver:
    """Answers Triton's runtime as a device of compute capability `arch` would; nothing runs."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> str:
        return f"sm_{self.target.arch}"  # one JIT cache per architecture

    def get_current_stream(self, device: object) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclass(frozen=True)
class Launch:
    kernel: str  # module:name
    arch: int
    spec: str  # Triton's specialization data (JSON)
    labels: tuple[str, ...]  # the workloads that launch it: "Llama-3-8B bf16 decode x4"


@contextlib.contextmanager
def recording(arch: int) -> Iterator[list[tuple[str, str]]]:
    """Launches made inside are recorded as (kernel, specialization data), not run."""
    from triton import knobs
    from triton.runtime.driver import driver

    seen: list[tuple[str, str]] = []

    def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        seen.append((f"{fn.module}:{fn.name}", compile["specialization_data"]))
        return True  # skip compiling and launching

    previous, active = knobs.runtime.jit_cache_hook, driver._active
    knobs.runtime.jit_cache_hook = hook
    driver.set_active(StandInDriver(arch))
    try:
        yield seen
    finally:  # NOTE: not reset_active(): that builds the default driver, absent without CUDA
        knobs.runtime.jit_cache_hook = previous
        driver._active = active


def record_launches(archs: list[int]) -> list[Launch]:
    """Every distinct launch of every workload, per architecture."""
    found: dict[tuple[str, int, str], list[str]] = {}
    for arch in archs:
        for label, run in workloads():
            with recording(arch) as seen:
                run()
            for kernel, spec in seen:
                labels = found.setdefault((kernel, arch, spec), [])
                if label not in labels:
                    labels.append(label)
    return [Launch(k, a, s, tuple(labels)) for (k, a, s), labels in found.items()]


# --- compiling --------------------------------------------------------------------------------

PTXAS_RE = {
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "registers": re.compile(r"Used (\d+) registers"),
}


def occupancy(arch: Arch, registers: int, shared: int, num_warps: int) -> int:
    """Resident warps per SM (the occupancy calculator's rules: registers allocated per warp in
    units of 256, 1 KiB of shared memory reserved per block)."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = arch.regs_per_sm // regs_per_warp // num_warps
    by_smem = arch.smem_per_sm // (shared + 1024)
    blocks = min(arch.max_blocks_per_sm, arch.max_warps_per_sm // num_warps, by_regs, by_smem)
    return blocks * num_warps


def compile_launch(launch: Launch) -> dict[str, Any]:
    """Compiles one recorded launch for its architecture; its resources from ptxas."""
    from triton import knobs
    from triton.runtime.driver import driver

    module, name = launch.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    knobs.nvidia.dump_ptxas_log = True
    driver.set_active(StandInDriver(launch.arch))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = fn.preload(launch.spec)
    text = log.getvalue()
    found = {key: [int(v) for v in rx.findall(text)] for key, rx in PTXAS_RE.items()}
    if not found["registers"]:
        raise RuntimeError(f"no ptxas report for {launch.kernel} on sm_{launch.arch}: {text}")
    meta = compiled.metadata
    spec = json.loads(launch.spec)
    names = fn.arg_names
    constexprs = {
        names[key[0]]: val
        for key, val in zip(spec["constant_keys"], spec["constant_vals"], strict=True)
    }
    resources = {k: max(v) for k, v in found.items()}
    arch = ARCHS[launch.arch]
    return {
        "kernel": name,
        "arch": f"sm_{launch.arch}",
        "gpu": arch.name,
        "dtype": _dtype(spec["signature"]),
        "constexprs": constexprs,
        "num_warps": meta.num_warps,
        "num_stages": meta.num_stages,
        **resources,
        "shared": meta.shared,
        "shared_limit": arch.smem_per_block,
        "warps_per_sm": occupancy(arch, resources["registers"], meta.shared, meta.num_warps),
        "cubin_bytes": len(compiled.asm["cubin"]),
        "workloads": list(launch.labels),
    }


def _dtype(signature: dict[str, str]) -> str:
    """The dtype a launch computes in: its 16-bit pointers' if any (the split-K reduction
    reads fp32 partials into a 16-bit output), else fp32."""
    pointers = {ty[1:] for ty in signature.values() if ty.startswith("*")}
    return next((t for t in ("fp16", "bf16") if t in pointers), "fp32")


def _worker_init(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # a fresh cache: ptxas runs for every launch
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def compile_all(launches: list[Launch], workers: int | None = None) -> list[dict[str, Any]]:
    import multiprocessing

    workers = workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="pagedllm-triton-") as cache_dir:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, ctx, _worker_init, (cache_dir,)) as pool:
            return list(pool.map(compile_launch, launches, chunksize=1))


def report(archs: list[int] | None = None, workers: int | None = None) -> dict[str, Any]:
    """The resource table of every kernel launch on every architecture, and what it checks."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("run without TRITON_INTERPRET: the interpreter compiles nothing")
    archs = archs or list(ARCHS)
    kernels = discover_kernels()
    launches = record_launches(archs)
    rows = compile_all(launches, workers)
    return {
        "triton": importlib.import_module("triton").__version__,
        "kernels": sorted(kernels),
        "launched": sorted({launch.kernel for launch in launches}),
        "archs": {f"sm_{a}": ARCHS[a].name for a in archs},
        "configurations": {f"sm_{a}": sum(r["arch"] == f"sm_{a}" for r in rows) for a in archs},
        "rows": rows,
    }


# --- the table in docs/gpu.md -----------------------------------------------------------------


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per kernel x dtype x head dim; its distinct launch options (MHA and GQA may
    differ); per architecture the worst case over its variants (window, soft-cap, split,
    GQA): registers, shared memory, resident warps per SM."""
    archs = sorted({r["arch"] for r in rows}, key=lambda a: int(a[3:]))
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        width = r["constexprs"].get("BLOCK_D")
        labels = {64: "64", 128: "80-128"}  # 80 and 96 run as 128
        dims = "-" if width is None else labels.get(max(width, 64), str(width))
        groups.setdefault((r["kernel"], r["dtype"], dims), []).append(r)
    head = ["kernel", "dtype", "head dim", "tile, warps, stages", "variants", *archs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def options(r: dict[str, Any]) -> str:
        c = r["constexprs"]
        tile = "x".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_G", "BLOCK_H", "BLOCK_N") if k in c)
        return f"{tile or '-'}, {r['num_warps']}, {r['num_stages']}"

    def order(key: tuple[str, str, str]) -> tuple[str, str, int]:
        return key[0], key[1], int(key[2].split("-")[0]) if key[2] != "-" else 0

    for (kernel, dtype, dims), group in sorted(groups.items(), key=lambda item: order(item[0])):
        cells = []
        for arch in archs:
            on = [r for r in group if r["arch"] == arch]
            spills = max(r["spill_stores"] + r["spill_loads"] for r in on)
            cell = (
                f"{max(r['registers'] for r in on)} regs, "
                f"{max(r['shared'] for r in on) / 1024:.0f} KiB, "
                f"{min(r['warps_per_sm'] for r in on)} warps/SM"
            )
            cells.append(cell + (f", **{spills} B spilled**" if spills else ""))
        launches = " / ".join(sorted({options(r) for r in group}))
        count = len(group) // len(archs)
        lines.append(
            f"| `{kernel}` | {dtype} | {dims} | {launches} | {count} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"
