"""An fp8 KV cache's per-layer scales (vLLM's k_scale / v_scale, model/kv_scales.py): the
reference path's write and read, scales read from a checkpoint under vLLM's names, and scales
estimated from the first forward (calculate_kv_scales). The Triton kernels' are checked
against the reference in test_triton_kernels.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_model, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import kv_quant

# layer -> the tensors a checkpoint carries for it, in each of vLLM's spellings
CHECKPOINT_SCALES = {  # (the tiny llama has two layers)
    0: {"self_attn.k_scale": 0.037, "self_attn.v_proj.output_scale": 0.53},
    1: {"self_attn.kv_scale": 0.11, "self_attn.q_scale": 5.0},  # q_scale: read past
}
EXPECTED = [(0.037, 0.53), (0.11, 0.11)]


def test_reference_write_divides_and_read_multiplies() -> None:
    cache = torch.zeros(4, 8, 2, 2, 16, dtype=torch.float8_e4m3fn)
    kv = torch.randn(6, 2, 2, 16) * 3
    slots = torch.tensor([3, 9, 10, 17, 30, 31])
    scales = (0.3, 1.7)
    kv_quant.write(cache, slots, kv, scales)
    stored = kv_quant.gather_blocks(cache, torch.arange(4), torch.float32).view(-1, 2, 2, 16)
    per_kv = torch.tensor(scales).view(2, 1, 1)
    assert torch.equal(stored[slots], (kv / per_kv).to(torch.float8_e4m3fn).float())
    back = kv_quant.gather_blocks(cache, torch.arange(4), torch.float32, scales)
    assert torch.equal(back.view(-1, 2, 2, 16)[slots], stored[slots] * per_kv)


def _with_scales(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(weights)
    for layer, named in CHECKPOINT_SCALES.items():
        for name, value in named.items():
            tensors[f"model.layers.{layer}.{name}"] = torch.tensor(value)
    save_file(tensors, weights, metadata={"format": "pt"})
    return dst


def _logprobs(path: Path, prompts: list[list[int]], **knobs: object) -> tuple[list, LLM]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(str(path), dtype="float32", device="cpu", **knobs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, False)
    got = []
    for o in outs:
        c = o.outputs[0]
        got.append([(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
    return got, llm


def test_checkpoint_scales_are_read_and_used(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Each of vLLM's spellings sets its layer's scales (a per-tensor scale); the fp8
    run with them differs from the scale-1 run and stays as close to the unquantized cache
    (a scale applied on the write alone, or the read alone, would be far from it)."""
    plain = checkpoints["llama"]
    path = _with_scales(plain, tmp_path / "scaled")
    prompts = random_prompts(3, (20, 40), 384, seed=11)
    scaled, llm = _logprobs(path, prompts, kv_cache_dtype="fp8")
    layers = llm.engine.runner.model.layer_weights
    for w, expected in zip(layers, EXPECTED, strict=True):  # (as fp32 tensors)
        assert (w.attn.k_scale, w.attn.v_scale) == pytest.approx(expected, rel=1e-6)
    unit, _ = _logprobs(plain, prompts, kv_cache_dtype="fp8")
    auto, _ = _logprobs(path, prompts, attention_backend="torch")  # ignores the scales
    tokens = [[t for t, _ in row] for row in auto]
    assert [[t for t, _ in row] for row in scaled] == tokens
    diff_unit, diff_auto = _gap(scaled, unit), _gap(scaled, auto)
    assert diff_unit > 1e-5 and diff_auto < 0.05, (diff_unit, diff_auto)


def _gap(a: list, b: list) -> float:
    """The largest difference of two runs' logprobs of their tokens (inf once they choose
    different tokens)."""
    pairs = [(x, y) for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True)]
    if any(x[0] != y[0] for x, y in pairs):
        return float("inf")
    return max(abs(x[1] - y[1]) for x, y in pairs)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_estimated_scales_are_the_first_batchs_amax(
    checkpoints: dict[str, Path], kind: str
) -> None:
    """calculate_kv_scales: each layer's k_scale / v_scale is the first forward's amax of
    its keys / values (after the rotary embedding: HF's cache holds the same) over the
    format's largest value (448 for e4m3, 57344 for e5m2). The first layer's inputs are
    HF's; the later ones' come through the fp8 cache of the layers before (within 5 %)."""
    path = checkpoints["llama"]
    prompt = random_prompts(1, (30, 31), 384, seed=2)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", kv_cache_dtype=kind,
             calculate_kv_scales=True) as llm:  # fmt: skip
        llm.generate([{"prompt_token_ids": prompt}], params, False)
        layers = llm.engine.runner.model.layer_weights
    with torch.no_grad():
        cache = hf_model(path)(torch.tensor([prompt]), use_cache=True).past_key_values
    top = torch.finfo(torch.float8_e4m3fn if kind == "fp8_e4m3" else torch.float8_e5m2).max
    for i, w in enumerate(layers):
        k, v = cache.layers[i].keys, cache.layers[i].values
        expected = (k.abs().amax().item() / top, v.abs().amax().item() / top)
        rel = 1e-4 if i == 0 else 0.05
        assert (w.attn.k_scale, w.attn.v_scale) == pytest.approx(expected, rel=rel), i


def test_llm_engine_parameter_and_environment(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llm_engine's `calculate_kv_scales` parameter, and PAGEDLLM_CALCULATE_KV_SCALES (what
    `pagedllm serve --calculate-kv-scales` sets) over it; unset: false."""
    from pagedllm.serving.settings import engine_config

    params = {"model_dir": str(checkpoints["llama"]), "kv_cache_dtype": "fp8"}
    assert not engine_config(params, "cpu").cache.calculate_kv_scales
    on = engine_config({**params, "calculate_kv_scales": "true"}, "cpu")
    assert on.cache.calculate_kv_scales and on.cache.cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        engine_config({**params, "calculate_kv_scales": "maybe"}, "cpu")
    monkeypatch.setenv("PAGEDLLM_CALCULATE_KV_SCALES", "true")
    assert engine_config(params, "cpu").cache.calculate_kv_scales
