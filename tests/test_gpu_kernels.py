"""On a CUDA device: the very launches that CI compiles (tests/test_kernels_compile.py, from
pagedllm.layers.kernel_workloads) run with random values against the pure-PyTorch reference
backend, for every model shape and kind of layer (window, soft-cap) we claim and
fp16/bf16/fp32; and what the device compiles is
what CI recorded for its architecture, launch for launch. Run in a process of its own (no
interpreted tests before it; see docs/gpu.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# absolute, outputs ~1 (docs/gpu.md, Precision)
ATOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def reference(case: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(output of each layer, cache after the writes) of the reference backend on the case's
    values."""
    from pagedllm.layers.attention.torch_ref import TorchAttentionBackend

    ref = TorchAttentionBackend()
    # head-major (blocks, 2, kv, slot, dim) -> reference (blocks, slot, 2, kv, dim)
    cache = case.cache.permute(0, 3, 1, 2, 4).contiguous()
    meta = ref.build_metadata(case.step)
    outs = [ref.forward(case.q, case.kv, cache, meta, layer) for layer in case.layers]
    return outs, cache.permute(0, 2, 3, 1, 4)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_every_claimed_shape_matches_the_reference(dtype: str) -> None:
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
    from pagedllm.layers.kernel_workloads import DTYPES, GEOMETRIES, attention_cases, run_case

    backend = TritonAttentionBackend()
    backend.kernel_config(torch.device("cuda"))
    gen = torch.Generator("cuda").manual_seed(0)
    failures = []
    for geo in GEOMETRIES:
        for case in attention_cases(geo, DTYPES[dtype], "cuda", generator=gen):
            expected, ref_cache = reference(case)
            outs = run_case(backend, case)
            torch.cuda.synchronize()
            if not torch.equal(case.cache, ref_cache):
                failures.append(f"{case.label}: the cache")
            for layer, out, want in zip(case.layers, outs, expected, strict=True):
                error = (out.float() - want.float()).abs().max().item()
                if error > ATOL[out.dtype]:
                    failures.append(f"{case.label} {layer}: max error {error:.2e}")
    assert not failures, failures


def test_the_device_compiles_what_ci_compiled() -> None:
    """Every specialization compiled here (signature, constexprs, alignment, options, target)
    is one the stand-in driver recorded for this architecture."""
    from triton import knobs

    from pagedllm.layers.all_workloads import workloads
    from pagedllm.layers.kernel_compile import record_launches

    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    seen: list[tuple[str, str]] = []

    def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        seen.append((f"{fn.module}:{fn.name}", compile["specialization_data"]))
        return False  # compile and run as usual

    knobs.runtime.jit_cache_hook = hook
    try:
        for _, run in workloads("cuda"):
            run()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = None
    recorded = {(launch.kernel, canonical(launch.spec)) for launch in record_launches([arch])}
    device = {(kernel, canonical(spec)) for kernel, spec in seen}
    assert device, "no kernel compiled"
    assert device <= recorded, sorted(k for k, _ in device - recorded)


def canonical(spec: str) -> str:
    data = json.loads(spec)
    data.pop("key", None)  # the cache key repeats the rest in a device-specific form
    return json.dumps(data, sort_keys=True)
