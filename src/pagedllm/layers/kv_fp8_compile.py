"""The attention kernels over fp8 KV caches (kv_cache_dtype fp8_e4m3 / fp8_e5m2) compiled for
sm_80/89/90/100 with no GPU, through kernel_compile's recording and ptxas report: head dims
64, 128 and 256 (a windowed layer among them), 16-bit queries, both fp8 formats. Where Triton
cannot lower a format for an architecture (e4m3, its `fp8e4nv`, below sm_89) the launch is
listed as refused: the engine refuses that cache dtype there (kv_cache_dtype.check_fp8_e4m3)."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers import kernel_compile as kc
from pagedllm.layers.kernel_workloads import GEOMETRIES, attention_cases, run_case

MODELS = ("SmolLM2-135M", "Llama-3-8B", "Gemma-3-4B")
QUERY_DTYPES = {"SmolLM2-135M": torch.float16, "Llama-3-8B": torch.bfloat16}
FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def record(archs: list[int]) -> list[kc.Launch]:
    """Every distinct launch over an fp8 cache, per architecture (decodes unsplit and split)."""
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    found: dict[tuple[str, int, str], list[str]] = {}
    for arch in archs:
        for geo in (g for g in GEOMETRIES if g.model in MODELS):
            dtype = QUERY_DTYPES.get(geo.model, torch.bfloat16)
            for name, fmt in FORMATS.items():
                label = f"{geo.model} {name} hd{geo.head_dim}"
                with kc.recording(arch) as seen:
                    backend = TritonAttentionBackend()
                    for case in attention_cases(geo, dtype, "cpu", 2):
                        case.cache = case.cache.to(fmt)
                        run_case(backend, case)
                for kernel, spec in seen:
                    found.setdefault((kernel, arch, spec), []).append(label)
    return [kc.Launch(k, a, s, tuple(dict.fromkeys(v))) for (k, a, s), v in found.items()]


def _compile(launch: kc.Launch) -> dict[str, Any]:
    try:
        return kc.compile_launch(launch)
    except Exception as e:  # a CompilationError: "type fp8e4nv not supported in this arch..."
        if "not supported in this architecture" not in str(e):
            raise
        name = launch.kernel.split(":")[1]
        return {
            "kernel": name,
            "arch": f"sm_{launch.arch}",
            "refused": str(e).strip().splitlines()[-1],
            "workloads": list(launch.labels),
        }


def report(archs: list[int] | None = None, workers: int | None = None) -> dict[str, Any]:
    import multiprocessing
    import os
    import tempfile
    from concurrent.futures import ProcessPoolExecutor

    launches = record(archs or list(kc.ARCHS))
    workers = workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="pagedllm-triton-") as cache_dir:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, ctx, kc._worker_init, (cache_dir,)) as pool:
            rows = list(pool.map(_compile, launches, chunksize=1))
    return {"launches": len(launches), "rows": rows}
