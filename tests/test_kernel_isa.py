"""The CPU kernels built for other x86 ISAs than this machine's: AVX2 without AVX-512 or VNNI
(`-march=haswell`, an AMD EPYC's path: 8-lane vectors, maddubs / madd integer dots, one group
per vector) and no AVX at all (`-march=x86-64-v2`: the portable vector-extension code), each
against dequantize-then-matmul as tests/test_quantization.py states it. `-march=native` only
ever compiles this machine's branch of each `#if`; these compile and run the others (a
subset of this CPU's ISA, so they run here), except where this CPU's own build takes the
same branches. Per ISA, the linear kernels' sources as shipped (-O3) and, for the other
kernels' branches, the whole extension compiled without optimization (a compile check: it
takes as long as the headers, half of an -O3 build); about a minute, all at once (a build
keeps one core busy)."""

from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from test_quantization import _formats, _int8_activations

from pagedllm.layers import quant
from pagedllm.layers.attention import cpu_kernels

_EMPTY = torch.empty(0)
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


# the linear kernels' sources, the shipped order from elementwise.cpp (the experts need its
# dtype dispatch) to moe.cpp, and functions
_ALL = cpu_kernels._SOURCES
LINEAR_SOURCES = _ALL[_ALL.index("elementwise.cpp") : _ALL.index("moe.cpp") + 1]
LINEAR_FUNCTIONS = ("linear_dense", "linear_int8", "linear_int4", "fused_moe")


def build(march: str, whole: bool) -> Any:
    """The linear kernels for `march` as shipped (-O3), or the whole extension at -O0."""
    from torch.utils.cpp_extension import load_inline

    flags = [f"-march={march}" if f == "-march=native" else f for f in cpu_kernels._CFLAGS]
    sources = [(cpu_kernels.CSRC / name).read_text(encoding="utf-8") for name in LINEAR_SOURCES]
    functions = list(LINEAR_FUNCTIONS)
    if whole:
        flags = ["-O0" if f == "-O3" else f for f in flags]
        sources, functions = cpu_kernels._source_text(), list(cpu_kernels._FUNCTIONS)
    kind = "o0" if whole else "linear"
    return load_inline(
        name=f"{cpu_kernels.extension_name()}_{march.replace('-', '_')}_{kind}",
        cpp_sources=sources,
        functions=functions,
        extra_cflags=flags,
        extra_ldflags=list(cpu_kernels._LDFLAGS),
        extra_include_paths=[str(cpu_kernels.CSRC)],
    )


@pytest.fixture(scope="module")
def builds() -> dict[tuple[str, bool], Any]:
    """For each ISA this CPU can run: (march, whole) -> its build, all built side by side."""
    keys = [
        (march, whole)
        for march, flags in ISAS.items()
        if flags <= cpu_kernels.cpu_flags() and not native_takes(march)
        for whole in (False, True)
    ]
    with ThreadPoolExecutor(len(keys) or 1) as pool:
        return dict(zip(keys, pool.map(lambda key: build(*key), keys), strict=True))


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
def test_linear_kernels_on_another_isa(march: str, builds: dict[tuple[str, bool], Any]) -> None:
    module = _built(march, False, builds)
    for n, k in [(67, 64), (33, 96), (130, 1536)]:
        for rows in (1, 2, 6, 13, 14):  # 13, 14: AVX2 tiles of 3 rows, then 1 or 2
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


@pytest.mark.parametrize("march", sorted(ISAS))
def test_experts_on_another_isa(march: str, builds: dict[tuple[str, bool], Any]) -> None:
    """csrc/moe.cpp's fused experts (dense: moe_gemm.cpp's tiles of up to 3 rows of x on 8
    lanes; int8: qgemv.cpp's blocks) against the experts computed in fp64 from the same
    weights: 1 to 14 tokens on one expert, one on another."""
    module = _built(march, False, builds)
    h, inter = 96, 64
    torch.manual_seed(0)
    w13, w2 = torch.randn(3, 2 * inter, h) / h**0.5, torch.randn(3, h, inter) / inter**0.5
    q13 = [quant.quantize(w, "int8") for w in w13]
    q2 = [quant.quantize(w, "int8") for w in w2]
    formats = {
        "fp32": ([w13], [w2], w13, w2, False),
        "int8": (
            [torch.stack([q.qweight for q in q13]), torch.stack([q.scales for q in q13]), _EMPTY],
            [torch.stack([q.qweight for q in q2]), torch.stack([q.scales for q in q2]), _EMPTY],
            torch.stack([q.dequantize() for q in q13]),
            torch.stack([q.dequantize() for q in q2]),
            True,
        ),
    }
    for n in range(1, 15):
        ids = torch.tensor([1] * n + [2]).view(-1, 1)
        weights = torch.rand(n + 1, 1)
        x = torch.randn(n + 1, h)
        for name, (p13, p2, d13, d2, rounded) in formats.items():
            out = module.fused_moe(x, weights, ids, p13, None, p2, None, "silu", 7.0, -1)
            assert out is not None
            expected = torch.empty(n + 1, h, dtype=torch.float64)
            for t in range(n + 1):
                e = int(ids[t, 0])
                xt = _int8_activations(x[t : t + 1]) if rounded else x[t : t + 1]
                gate, up = (xt.double() @ d13[e].double().T).chunk(2, -1)
                act = torch.nn.functional.silu(gate) * up
                act = _int8_activations(act.float()).double() if rounded else act
                expected[t] = weights[t, 0] * (act @ d2[e].double().T)[0]
            err = (out.double() - expected).abs().max() / expected.abs().max()
            assert err < (1e-3 if rounded else 1e-5), (march, name, n, err)


@pytest.mark.parametrize("march", sorted(ISAS))
def test_every_kernel_compiles_on_another_isa(
    march: str, builds: dict[tuple[str, bool], Any]
) -> None:
    """The attention, elementwise and decoder kernels' branches for `march` compile and load
    (the linear ones also run above)."""
    module = _built(march, True, builds)
    assert all(callable(getattr(module, name)) for name in cpu_kernels._FUNCTIONS)


def _built(march: str, whole: bool, builds: dict[tuple[str, bool], Any]) -> Any:
    if native_takes(march):
        pytest.skip(f"this CPU's own build takes {march}'s branches (the other kernel tests)")
    if (march, whole) not in builds:
        pytest.skip(f"this CPU cannot run {march} code")
    return builds[march, whole]
