"""The fused CPU elementwise ops of cpu_kernels (RMSNorm, add + RMSNorm, SiLU-and-mul) against
the plain PyTorch formulas, and the model's fallback when the extension is unavailable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import is_ninja_available

from conftest import TINY, hf_greedy, hf_model, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import cpu_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: ulps of a different summation order (and exp polynomial); 16-bit: the kernels round
# once from fp32 where the formulas below do too, so at most one rounding step apart
RTOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
ATOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}
SHAPES = [(1, 576), (32, 576), (5, 37), (3, 16), (0, 64), (2, 3, 48)]
EPS = 1e-5


@pytest.fixture(scope="module")
def kernels() -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler found")
    if not is_ninja_available():
        pytest.skip("ninja missing: pip install ninja")
    assert cpu_kernels.load_kernels() is not None, "kernel build failed (see the log)"


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, in fp32 (or fp64) throughout, rounded once."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.to(h.dtype)).to(x.dtype)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.to(torch.promote_types(gate_up.dtype, torch.float32)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    return [x, residual, weight]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    dtype = expected.dtype
    assert actual.dtype == dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=RTOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.usefixtures("kernels")
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, _, weight = inputs(shape, dtype, 0)
    close(cpu_kernels.rms_norm(x, weight, EPS), hf_rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.usefixtures("kernels")
def test_fused_add_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, residual, weight = inputs(shape, dtype, 1)
    expected_residual = residual + x  # rounded to the dtype, as the kernel stores it
    expected = hf_rms_norm(expected_residual, weight, EPS)
    out, new_residual = cpu_kernels.fused_add_rms_norm(x, residual, weight, EPS)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.usefixtures("kernels")
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 4).to(dtype)
    close(cpu_kernels.silu_and_mul(gate_up), silu_mul_ref(gate_up))


@pytest.mark.usefixtures("kernels")
def test_fp32_matches_transformers_rms_norm_tightly() -> None:
    """The parity tests need fp32 RMSNorm equal to transformers' to ~1 ulp."""
    x, _, weight = inputs((64, 576), torch.float32, 3)
    for out in (
        cpu_kernels.rms_norm(x, weight, 1e-6),
        cpu_kernels.fused_add_rms_norm(x.clone(), torch.zeros_like(x), weight, 1e-6)[0],
    ):
        expected = hf_rms_norm(x, weight, 1e-6)
        assert ((out - expected).abs() / expected.abs()).max().item() <= 1e-6


@pytest.mark.usefixtures("kernels")
def test_silu_extremes() -> None:
    gate = torch.tensor([[-200.0, -90.0, -20.0, -1.0, 0.0, 1e-4, 1.0, 20.0, 90.0, 200.0] * 2])
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=-1)
    out = cpu_kernels.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate), rtol=1e-6, atol=1e-30)


@pytest.mark.usefixtures("kernels")
def test_non_contiguous_inputs() -> None:
    base_x, base_r, weight = inputs((6, 96), torch.float32, 4)
    # strided rows (a column slice) are used in place; transposed ones fall back
    x, residual = base_x[:, :48], base_r[:, 48:]
    expected_residual = residual + x
    expected = hf_rms_norm(expected_residual, weight[:48], EPS)
    out, new_residual = cpu_kernels.fused_add_rms_norm(x, residual, weight[:48], EPS)
    assert new_residual.data_ptr() == residual.data_ptr()
    close(new_residual, expected_residual)
    close(out, expected)

    xt, rt = base_x[:, :6].t(), base_r[:, :6].t()  # (6, 6), last stride 96
    expected_residual = rt + xt
    out, new_residual = cpu_kernels.fused_add_rms_norm(xt, rt, weight[:6], EPS)
    close(new_residual, expected_residual)
    close(out, hf_rms_norm(expected_residual, weight[:6], EPS))

    x3 = base_x.view(2, 3, 96).transpose(0, 1)  # 3-D, not contiguous: copied
    close(cpu_kernels.rms_norm(x3, weight, EPS), hf_rms_norm(x3, weight, EPS))
    close(
        cpu_kernels.rms_norm(base_x.t(), weight[:6], EPS), hf_rms_norm(base_x.t(), weight[:6], EPS)
    )
    gate_up = base_x.t()  # (96, 6)
    close(cpu_kernels.silu_and_mul(gate_up), silu_mul_ref(gate_up))
    gate_up = base_x[:, 16:64]  # strided rows
    close(cpu_kernels.silu_and_mul(gate_up), silu_mul_ref(gate_up))


@pytest.mark.usefixtures("kernels")
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_unsupported_inputs_fall_back() -> None:
    x, residual, weight = inputs((4, 32), torch.float64, 5)  # no fp64 kernel
    close(cpu_kernels.rms_norm(x, weight, EPS), hf_rms_norm(x, weight, EPS))
    expected = hf_rms_norm(x + residual, weight, EPS)
    close(cpu_kernels.fused_add_rms_norm(x, residual, weight, EPS)[0], expected)
    gate_up = torch.randn(4, 64, dtype=torch.float64)
    close(cpu_kernels.silu_and_mul(gate_up), silu_mul_ref(gate_up))
    # weight of another dtype than x: PyTorch's promotion, not the kernel
    x32 = x.float()
    close(cpu_kernels.rms_norm(x32, weight, EPS), F.rms_norm(x32, weight.shape, weight, EPS))


def test_fallback_without_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cpu_kernels._state, "module", None)
    for dtype in DTYPES:
        x, residual, weight = inputs((3, 40), dtype, 6)
        expected_residual = residual + x
        close(cpu_kernels.rms_norm(x, weight, EPS), hf_rms_norm(x, weight, EPS))
        out, new_residual = cpu_kernels.fused_add_rms_norm(x, residual, weight, EPS)
        close(new_residual, expected_residual)
        close(out, hf_rms_norm(expected_residual, weight, EPS))
        gate_up = torch.randn(3, 80).to(dtype)
        close(
            cpu_kernels.silu_and_mul(gate_up), (lambda g, u: F.silu(g) * u)(*gate_up.chunk(2, -1))
        )


def test_model_without_extension(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model on PyTorch alone (extension unavailable) keeps greedy parity with HF."""
    monkeypatch.setitem(cpu_kernels._state, "module", None)
    prompts = random_prompts(4, (5, 30), TINY["vocab_size"], seed=11)
    llm = LLM(str(checkpoints["llama"]), max_num_batched_tokens=24)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    expected = hf_greedy(hf_model(checkpoints["llama"]), prompts, 12, eos=None)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_kernel_disabled_by_env(checkpoints: dict[str, Path]) -> None:
    """PAGEDLLM_CPU_KERNEL=0 in a fresh process: no extension, and the model still runs."""
    script = (
        "import sys\n"
        "from pagedllm import LLM, SamplingParams\n"
        "from pagedllm.layers.attention import cpu_kernels\n"
        "llm = LLM(sys.argv[1], dtype='bfloat16')\n"
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}],\n"
        "                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),\n"
        "                   use_tqdm=False)\n"
        "print(cpu_kernels._state, len(out[0].outputs[0].token_ids))\n"
    )
    env = {**os.environ, "PAGEDLLM_CPU_KERNEL": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(checkpoints["llama"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "{'module': None} 4"


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "head_dim"), [(1, 64), (33, 128), (4, 8)])
def test_rotary_embedding_matches_transformers(
    n: int, head_dim: int, dtype: torch.dtype, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In place on the q and k heads of a qkv slice (strided rows), v untouched, equal to
    transformers' apply_rotary_pos_emb (half-split layout, run in fp32 and rounded once) after
    the loader's interleaving permutation; with the kernel and with its PyTorch fallback."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from pagedllm.model.rope import interleave_rows

    if not kernel:
        monkeypatch.setitem(cpu_kernels._state, "module", None)
    heads, kv_heads = 6, 2
    gen = torch.Generator().manual_seed(n)
    half_split = (torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen) * 2).to(dtype)
    half_split = half_split.float()  # the values representable in dtype
    angles = torch.rand(n, head_dim // 2, generator=gen) * 1000
    cos, sin = angles.cos(), angles.sin()

    def interleave(x: torch.Tensor) -> torch.Tensor:  # (n, h, hd), each head as the loader does
        h = x.shape[1]
        rows = interleave_rows(x.permute(1, 2, 0).reshape(h * head_dim, n), h, head_dim)
        return rows.view(h, head_dim, n).permute(2, 0, 1)

    qkv = interleave(half_split).contiguous().to(dtype)
    v_before = qkv[:, heads + kv_heads :].clone()
    rotary = torch.complex(cos, sin)[:, None]  # (n, 1, head_dim / 2), as rope.rotary_table
    cpu_kernels.rotary_embedding(qkv[:, : heads + kv_heads], rotary)

    q, k = half_split[:, :heads, None], half_split[:, heads : heads + kv_heads, None]
    full = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    hf_q, hf_k = apply_rotary_pos_emb(q, k, *full)
    expected = interleave(torch.cat([hf_q[:, :, 0], hf_k[:, :, 0]], 1)).to(dtype)
    close(qkv[:, : heads + kv_heads], expected)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)


def test_the_kernel_sources_ship_in_the_wheel() -> None:
    """Every C++ source the extension compiles is package data (built where it runs)."""
    import fnmatch
    import json
    import re

    from pagedllm.layers.attention import cpu_kernels

    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r"\[tool\.setuptools\.package-data\][^\[]*?\npagedllm = (\[.*?\])", pyproject)
    assert found, "pyproject.toml lacks [tool.setuptools.package-data] pagedllm"
    globs = json.loads(found.group(1))
    package = cpu_kernels.CSRC.parent
    files = [str(p.relative_to(package)) for p in cpu_kernels.CSRC.iterdir() if p.is_file()]
    assert {"csrc/vec.h", *(f"csrc/{name}" for name in cpu_kernels._SOURCES)} <= set(files)
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)


@pytest.mark.skipif(not cpu_kernels.kernel_available(), reason="no C++ toolchain")
def test_argmax_kernel_is_torch_argmax() -> None:
    """The greedy sampler's CPU argmax (one row per request, a vocabulary wide): the first
    maximum, ties and -inf rows included, a NaN counting as the maximum, as torch.argmax; rows
    shorter than a vector, and with a tail past the last full one."""
    module = cpu_kernels.kernel_module()
    torch.manual_seed(0)
    for rows, cols in [(1, 49152), (32, 49152), (3, 7), (5, 16), (2, 33), (4, 100)]:
        x = torch.randn(rows, cols)
        assert torch.equal(module.argmax_rows(x), x.argmax(-1)), (rows, cols)
    x = torch.zeros(4, 50)
    x[0, 7] = x[0, 40] = 1.0  # a tie: the first
    x[1] = -float("inf")  # all -inf: index 0
    x[2, 49] = 2.0  # in the tail past the last full vector
    x[3, [5, 45]] = float("nan")  # the first NaN
    assert module.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [7, 0, 49, 5]
    # what it does not take: the sampler falls back to torch
    assert module.argmax_rows(x.bfloat16()) is None and module.argmax_rows(x.t()) is None
