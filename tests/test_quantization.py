"""Weight-only quantization (layers/quant.py, csrc/gemv.cpp, model/gguf.py's blocks; GGUF
files of every family: test_gguf_families.py).

Oracles: arithmetic bounds for the quantizers; gguf-py's own block decoders for the GGUF
formats; dequantize-then-matmul in PyTorch for the kernels, with the stated int8 rounding of
the activations; and for whole engines, HF transformers running the same checkpoint with every
quantized weight replaced by its dequantized values and those layers' inputs rounded the same
way (row-wise quantization commutes with our fusing and permuting of rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import hf_greedy, hf_model, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, EngineConfig
from pagedllm.layers import quant
from pagedllm.layers.attention import cpu_kernels
from pagedllm.model import gguf as gguf_loader

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def test_int8_rounds_each_weight_to_within_half_a_step() -> None:
    w = torch.randn(37, 96) * torch.logspace(-3, 1, 37)[:, None]
    for group in (None, 32):
        qw = quant.quantize_int8(w, group)
        step = qw.scales.repeat_interleave(qw.group_size, dim=1)
        assert qw.qweight.dtype == torch.int8 and qw.qweight.abs().max() <= 127
        assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-7).all()
        assert (w.abs().amax(1) - qw.dequantize().abs().amax(1)).abs().max() < 1e-6 * 10


def test_int4_rounds_each_weight_to_within_half_a_step_of_its_group_range() -> None:
    w = torch.randn(19, 128) * 3
    qw = quant.quantize_int4(w)
    assert qw.qweight.shape == (19, 64) and qw.scales.dtype == torch.float16
    step = qw.scales.float().repeat_interleave(32, dim=1)
    # the fp16 rounding of min and scale moves the grid by at most a few ulps of them
    assert ((qw.dequantize() - w).abs() <= step / 2 + 2e-3 * w.abs().max()).all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_decode_exactly_as_gguf_py(qtype: str) -> None:
    data = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(data, Q[qtype])
    ours = gguf_loader._tensor(gguf, Q[qtype], blocks, (6, 96), "w")
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, Q[qtype]))
    assert torch.equal(ours.dequantize(), expected)


def test_int4_requantizes_q4_1_values_without_loss() -> None:
    """Q4_1 is our int4: quantizing a Q4_1 tensor's values gives back the same values."""
    data = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    values = gguf.quants.dequantize(gguf.quants.quantize(data, Q.Q4_1), Q.Q4_1)
    again = quant.quantize_int4(torch.from_numpy(values)).dequantize()
    assert torch.allclose(again, torch.from_numpy(values), rtol=0, atol=2e-3 * np.abs(values).max())


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """The stated rounding of what meets a quantized weight (as llama.cpp's Q8 activations):
    each group of 32 of the last dim to q = round(x * 127 / max |x|), ties to even, times
    max |x| / 127; in fp32."""
    g = x.float().unflatten(-1, (-1, 32))
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * torch.where(amax > 0, 127 / amax, 0.0))
    assert q.abs().max() <= 127
    return (q * (amax / 127)).flatten(-2)


def test_activations_are_rounded_to_int8_in_groups_of_32() -> None:
    x = torch.randn(5, 96) * torch.logspace(-4, 2, 96)
    x[1, 32:64] = 0  # an all-zero group stays zero
    assert torch.equal(quant.round_activations(x), _int8_activations(x))
    step = x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / 127
    err = (quant.round_activations(x) - x).unflatten(-1, (-1, 32)).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all()  # within half a step of its group
    odd = torch.randn(2, 48)  # not in groups of 32: no quantized kernel takes it, left as is
    assert torch.equal(quant.round_activations(odd), odd)


def _formats(w: torch.Tensor, dtype: torch.dtype) -> dict[str, quant.Weight]:
    """The weight quantized every way, and dense in the model's dtype (that of x)."""
    formats: dict[str, quant.Weight] = {
        "int8/channel": quant.quantize_int8(w),
        "int8/32": quant.quantize_int8(w, 32),
        "int4": quant.quantize_int4(w),
        "dense": w.to(dtype),
    }
    if w.shape[1] % 64 == 0:  # two groups of 32 sharing a scale
        formats["int8/64"] = quant.quantize_int8(w, 64)
    if w.shape[0] % quant.PACK_ROWS == 0:  # sixteen rows side by side (AVX-512 VNNI)
        for name in [name for name in formats if name != "dense"]:
            formats[f"{name} packed"] = cast(quant.QuantizedWeight, formats[name]).pack()
    return formats


@pytest.mark.parametrize("name", ["int8/channel", "int8/32", "int8/64", "int4"])
def test_packed_weights_hold_the_same_values(name: str) -> None:
    """`pack` (the layout of csrc/qgemv_packed.cpp) and `unpack` are inverses; a packed
    weight decodes, and looks up rows (a tied embedding), as the rows it came from."""
    torch.manual_seed(0)
    weight = cast(quant.QuantizedWeight, _formats(torch.randn(48, 128), torch.float32)[name])
    packed = weight.pack()
    assert packed.packed and not weight.packed and packed.shape == weight.shape == (48, 128)
    assert packed.group_size == weight.group_size and packed.nbytes == weight.nbytes
    back = packed.unpack()
    assert torch.equal(back.qweight, weight.qweight) and torch.equal(back.scales, weight.scales)
    assert weight.mins is None or torch.equal(cast(torch.Tensor, back.mins), weight.mins)
    assert torch.equal(packed.dequantize(), weight.dequantize())
    ids = torch.tensor([0, 17, 47, 5, 5, 31])
    assert torch.equal(packed.rows(ids, torch.float32), weight.rows(ids, torch.float32))
    assert torch.equal(packed.narrow(0, 16, 20).dequantize(), weight.narrow(0, 16, 20).dequantize())


@pytest.mark.skipif(not cpu_kernels.kernel_available(), reason="no C++ toolchain")
@pytest.mark.parametrize("path", ["kernels", "fallback"])
@pytest.mark.parametrize("rows", [1, 3, 6, 16, 17, 65, 129])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(67, 64), (33, 96), (48, 96), (5, 576), (130, 1536)])
def test_linear_matches_dequantize_then_matmul(
    rows: int,
    x_dtype: torch.dtype,
    shape: tuple[int, int],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """x (rounded to int8 in groups of 32 for a quantized weight, `_int8_activations`) times
    the decoded weight. Stated tolerance: 1e-5 of the output's magnitude in fp32 (summation
    order only); one rounding of y (and of the bias, and of rounded x past the kernels' rows)
    to bf16 / fp16 when x and y are 16-bit."""
    # every row count down each path, whatever this CPU's KERNEL_MAX_ROWS
    limit = None if path == "kernels" else 0
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS, limit))
    torch.manual_seed(rows)
    n, k = shape
    w, bias = torch.randn(n, k), torch.randn(n)
    x = torch.randn(rows, k).to(x_dtype)
    for name, weight in _formats(w, x_dtype).items():
        quantized = isinstance(weight, quant.QuantizedWeight)
        dense = weight.dequantize() if quantized else weight
        b = bias.to(x_dtype)
        xr = _int8_activations(x) if quantized else x
        expected = xr.double() @ dense.double().T + b.double()
        out = quant.linear(x, weight, b)
        assert out.dtype == x_dtype and out.shape == (rows, n), name
        tol = 1e-5 if x_dtype == torch.float32 else 2**-7
        err = (out.double() - expected).abs().max() / expected.abs().max()
        assert err < tol, (name, err)


@pytest.mark.skipif(not cpu_kernels.kernel_available(), reason="no C++ toolchain")
def test_kernels_refuse_what_they_do_not_handle() -> None:
    """K not a multiple of 32, a non-contiguous weight: None, and linear() still computes."""
    module = cpu_kernels.kernel_module()
    w = torch.randn(8, 48)
    x = torch.randn(2, 48)
    assert module.linear_dense(x, w.bfloat16(), None) is None
    q8 = quant.quantize_int8(w)
    assert module.linear_int8(x, q8.qweight, q8.scales, None) is None
    assert torch.allclose(quant.linear(x, q8), x @ q8.dequantize().T, atol=1e-5)  # not rounded
    w64 = torch.randn(64, 8).T  # (8, 64), not contiguous
    assert module.linear_dense(torch.randn(1, 64), w64.bfloat16(), None) is None


# ---- whole engines against HF on the dequantized weights ---------------------------------

# (Phi-3 fuses q/k/v and gate/up in its checkpoint: rows are quantized alike fused or not)
_LINEARS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
_LINEARS += ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
_LINEARS += ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")  # latent attention's (not kv_b_proj)


def _round_inputs(modules: list[torch.nn.Module]) -> None:
    """Each module's input rounded as the quantized kernels round what they multiply."""
    for module in modules:
        module.register_forward_pre_hook(
            lambda _, args: (_int8_activations(args[0]).to(args[0].dtype), *args[1:])
        )


def _rounding_matmuls(module: torch.nn.Module) -> None:
    """While `module` runs, every F.linear / @ rounds its left operand as the kernels do (the
    experts of a MoE: their stacked weights are not modules to hook)."""
    saved: dict[str, Any] = {}

    def on(*_: Any) -> None:
        saved["linear"], saved["matmul"] = F.linear, torch.Tensor.__matmul__
        F.linear = lambda x, w, b=None: saved["linear"](_int8_activations(x).to(x.dtype), w, b)
        torch.Tensor.__matmul__ = lambda x, w: saved["matmul"](_int8_activations(x).to(x.dtype), w)  # type: ignore[method-assign]

    def off(*_: Any) -> None:
        F.linear, torch.Tensor.__matmul__ = saved["linear"], saved["matmul"]  # type: ignore[method-assign]

    module.register_forward_pre_hook(on)
    module.register_forward_hook(off)


@torch.no_grad()
def _dequantize_experts(model: Any, method: str) -> None:
    """Each expert's weights of the stacked MoE modules (transformers' (E, out, in), gpt-oss's
    (E, in, out)) quantized as ours are, per expert; their inputs rounded (through their
    eager forward: the only one whose matmuls can be hooked)."""
    if any(name.endswith(".experts") for name, _ in model.named_modules()):
        model.set_experts_implementation("eager")
    for name, module in model.named_modules():
        if not name.endswith(".experts") or not hasattr(module, "gate_up_proj"):
            continue
        x_at_w = hasattr(module, "gate_up_proj_bias")  # gpt-oss
        for p in (module.gate_up_proj, module.down_proj):
            for e in range(p.shape[0]):
                w = p[e].T if x_at_w else p[e]
                w = quant.quantize(w.contiguous(), method).dequantize()
                p[e].copy_(w.T if x_at_w else w)
        _rounding_matmuls(module)


def dequantized_hf(path: Path, method: str) -> Any:
    """HF's model of `path` with what `LLM(quantization=method)` quantizes replaced by its
    dequantized values, and those layers' inputs rounded to int8 in groups of 32."""
    model = hf_model(path)
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in _LINEARS]
    _dequantize_experts(model, method)
    with torch.no_grad():
        for module in linears:
            module.weight.copy_(quant.quantize(module.weight, method).dequantize())
        embed = model.get_input_embeddings().weight
        embed.copy_(quant.quantize_int8(embed).dequantize())
        head = model.get_output_embeddings().weight
        if head.data_ptr() != embed.data_ptr():
            head.copy_(quant.quantize_int8(head).dequantize())
    _round_inputs([*linears, model.get_output_embeddings()])
    return model


NEAR_TIE = 2e-3  # of the logits' range: what one flipped rounding of an activation moves


def assert_greedy_matches(
    model: Any, prompts: list[list[int]], ours: list[list[int]], expected: list[list[int]]
) -> None:
    """Ours equals HF's greedy tokens, but where HF itself has a near-tie: rounding to int8
    turns a difference of summation order (1e-7) into a whole step of one activation now and
    then, so a sequence may part from HF's where its top two logits are that close (and is
    not compared after)."""
    parted = 0
    for prompt, got, want in zip(prompts, ours, expected, strict=True):
        j = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if j is None:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + want[:j]])).logits[0, -1]
        gap = (logits[want[j]] - logits[got[j]]).item()
        assert gap <= NEAR_TIE * (logits.max() - logits.min()).item(), (j, gap, got, want)
        parted += 1
    assert parted <= len(prompts) // 4, f"{parted} of {len(prompts)} parted from HF"


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_quantized_engine_matches_hf_on_dequantized_weights(
    checkpoints: dict[str, Path], arch: str, method: str
) -> None:
    """Greedy tokens under batching (12 requests at once), chunked prefill (16-token chunks,
    through the kernels) and prefix hits (the second run reuses the first run's blocks)."""
    path = checkpoints[arch]
    shared = random_prompts(1, (20, 20), 384, seed=5)[0]
    prompts = [shared + p for p in random_prompts(6, (3, 30), 384, seed=6)]
    prompts += random_prompts(6, (1, 40), 384, seed=7)
    model = dequantized_hf(path, method)
    expected = hf_greedy(model, prompts, 12, eos=None)
    llm = LLM(str(path), quantization=method, max_num_batched_tokens=16, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hits = []
    for _ in range(2):  # the second run hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_greedy_matches(model, prompts, [o.outputs[0].token_ids for o in outs], expected)
        hits.append(llm.engine.scheduler.kv.prefix_hits)
    assert hits[1] - hits[0] >= 16 * 6  # at least the shared block of the six
    # where the kernels take packed weights, the loader packed every one (N: multiples of 16)
    weights = llm.engine.runner.model.quantized.values()
    assert weights and all(w.packed == quant.packs_on_cpu() for w in weights)


def test_bad_quantization_settings_are_config_errors(checkpoints: dict[str, Path]) -> None:
    """(A GGUF file's bad types and architectures: tests/test_gguf_families.py.)"""
    with pytest.raises(ConfigError, match="unsupported quantization 'int3'"):
        EngineConfig.create(checkpoints["llama"], quantization="int3", device="cpu")
    assert EngineConfig.create(checkpoints["llama"], quantization="None").quantization is None
    with pytest.raises(ConfigError, match=r"exactly one \*\.gguf file .* \(found none\)"):
        LLM(str(checkpoints["llama"]), quantization="gguf")


def test_serving_settings_and_cli_defaults(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llm_engine's `quantization` parameter (PAGEDLLM_QUANTIZATION overrides it) reaches the
    engine's config; `pagedllm serve` runs the default model on its GGUF on a CPU."""
    from pagedllm.cli import main
    from pagedllm.serving import launcher
    from pagedllm.serving.settings import engine_config

    params = {"model_dir": str(checkpoints["llama"]), "quantization": "int4"}
    monkeypatch.delenv("PAGEDLLM_QUANTIZATION", raising=False)
    assert engine_config(params).quantization == "int4"
    monkeypatch.setenv("PAGEDLLM_QUANTIZATION", "int8")
    assert engine_config(params).quantization == "int8"
    calls: list[Any] = []
    monkeypatch.setattr(launcher, "serve", lambda *args: calls.append(args[7]) or 0)  # quantization
    for argv in (["serve"], ["serve", "--model", "/m"], ["serve", "--quantization", "int4"]):
        assert main(argv) == 0
    assert calls == ["gguf", "none", "int4"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_engine_on_a_gpu_matches_hf(checkpoints: dict[str, Path], method: str) -> None:
    """On CUDA the weights are decoded by torch for cuBLAS (CUDA graphs capture that too)."""
    path = checkpoints["llama"]
    prompts = random_prompts(4, (5, 30), 384, seed=9)
    expected = hf_greedy(dequantized_hf(path, method), prompts, 8, eos=None)
    llm = LLM(str(path), quantization=method, device="cuda", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
