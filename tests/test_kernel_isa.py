"""The CPU kernels built for other x86 ISAs than this machine's: AVX2 without AVX-512 or VNNI
(`-march=haswell`, an AMD EPYC's path: 8-lane vectors, maddubs / madd integer dots, one group
per vector) and no AVX at all (`-march=x86-64-v2`: the portable vector-extension code), each
against dequantize-then-matmul as tests/test_quantization.py states it. `-march=native` only
ever compiles this machine's branch of each `#if`; these compile and run the others (a
subset of this CPU's ISA, so they run here), except where this CPU's own build takes the
same branches. About a minute per build, both at once (a build keeps one core busy)."""

from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from test_quantization import _formats, _int8_activations

from pagedllm.layers import quant
from pagedllm.layers.attention import cpu_kernels

# the flags each ISA needs of this CPU (/proc/cpuinfo names)
ISAS = {"haswell": {"avx2", "fma", "f16c", "bmi2"}, "x86-64-v2": {"sse4_2", "popcnt"}}
# the flags the kernels branch on (`#if defined(__AVX2__)` ... in src/pagedllm/csrc), and
# those of them each ISA has
BRANCHES = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni"}
ISA_BRANCHES = {"haswell": {"avx2", "fma", "f16c"}, "x86-64-v2": set()}


def native_takes(march: str) -> bool:
    """Whether `-march=native` compiles the same branches as `march` on this CPU: then every
    other kernel test has run them already (an AVX2 CPU without AVX-512 is haswell's case)."""
    return cpu_kernels.cpu_flags() & BRANCHES == ISA_BRANCHES[march]


pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not cpu_kernels.kernel_available(),
    reason="x86-64 with a C++ toolchain only",
)


def build(march: str) -> Any:
    from torch.utils.cpp_extension import load_inline

    flags = [f"-march={march}" if f == "-march=native" else f for f in cpu_kernels._CFLAGS]
    return load_inline(
        name=f"{cpu_kernels.extension_name()}_{march.replace('-', '_')}",
        cpp_sources=cpu_kernels._source_text(),
        functions=list(cpu_kernels._FUNCTIONS),
        extra_cflags=flags,
        extra_ldflags=list(cpu_kernels._LDFLAGS),
        extra_include_paths=[str(cpu_kernels.CSRC)],
    )


@pytest.fixture(scope="module")
def builds() -> dict[str, Any]:
    """The extension for each ISA this CPU can run, built side by side."""
    runnable = [
        march
        for march, flags in ISAS.items()
        if flags <= cpu_kernels.cpu_flags() and not native_takes(march)
    ]
    with ThreadPoolExecutor(len(runnable) or 1) as pool:
        return dict(zip(runnable, pool.map(build, runnable), strict=True))


def kernel_linear(module: Any, x: torch.Tensor, w: quant.Weight, bias: torch.Tensor) -> Any:
    """The kernel's own answer (None would mean it declined and PyTorch answered)."""
    if isinstance(w, torch.Tensor):
        out = module.linear_dense(x, w, bias)
    elif w.bits == 8:
        out = module.linear_int8(x, w.qweight, w.scales, bias)
    else:
        out = module.linear_int4(x, w.qweight, w.scales, w.mins, bias)
    assert out is not None
    return out


@pytest.mark.parametrize("march", sorted(ISAS))
def test_linear_kernels_on_another_isa(march: str, builds: dict[str, Any]) -> None:
    if native_takes(march):
        pytest.skip(f"this CPU's own build takes {march}'s branches (the other kernel tests)")
    if march not in builds:
        pytest.skip(f"this CPU cannot run {march} code")
    module = builds[march]
    for n, k in [(67, 64), (33, 96), (130, 1536)]:
        for rows in (1, 2, 6):
            torch.manual_seed(rows)
            w, bias = torch.randn(n, k), torch.randn(n)
            x = torch.randn(rows, k)
            for name, weight in _formats(w, x.dtype).items():
                quantized = isinstance(weight, quant.QuantizedWeight)
                dense = weight.dequantize() if quantized else weight
                xr = _int8_activations(x) if quantized else x
                expected = xr.double() @ dense.double().T + bias.double()
                out = kernel_linear(module, x, weight, bias)
                err = (out.double() - expected).abs().max() / expected.abs().max()
                assert err < 1e-5, (march, n, k, rows, name, err)
