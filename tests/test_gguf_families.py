"""GGUF files of every family as llama.cpp's converter writes them (model/gguf.py): its tensor
names (gguf-py's own name map), q/k rows permuted only for the archs its LlamaModel class
converts, Gemma's norm weights stored as 1 + w, Phi-3's fused attn_qkv and ffn_up, no output
tensor for Gemma 2. Oracle: HF transformers on the file's values (decoded by gguf-py, put back
into HF's layout), with the inputs of the quantized layers rounded as ours are
(test_quantization)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_quantization import _LINEARS, _round_inputs, assert_greedy_matches

from conftest import TINY, hf_greedy, hf_model, make_checkpoint, random_prompts
from families import make_family_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, ModelConfig
from pagedllm.families import FAMILIES
from pagedllm.model import gguf as gguf_loader
from pagedllm.model.gguf_moe import MOE_ARCHS
from pagedllm.model.loader import load_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# family -> (gguf-py's MODEL_ARCH, the type of the file's layer weights): Q8_0 and Q4_1 taking
# turns; embeddings (and output) in Q8_0, 1-D tensors in F32
CASES = {
    "llama": ("LLAMA", "Q4_1"),
    "mistral": ("LLAMA", "Q8_0"),
    "qwen2": ("QWEN2", "Q8_0"),
    "qwen3": ("QWEN3", "Q4_1"),
    "gemma2": ("GEMMA2", "Q8_0"),
    "gemma3": ("GEMMA3", "Q4_1"),
    "phi3": ("PHI3", "Q8_0"),
    "olmo2": ("OLMO2", "Q4_1"),
    "granite": ("GRANITE", "Q8_0"),
    "smollm3": ("SMOLLM3", "Q4_1"),
}
# what the converter does per arch: its LlamaModel and subclasses permute q/k rows (and
# biases), Gemma's classes add 1 to every `*norm.weight`, Gemma 2's drops lm_head
PERMUTED = ("LLAMA", "GRANITE", "SMOLLM3")
PLUS_ONE = ("GEMMA2", "GEMMA3")
NO_OUTPUT = ("GEMMA2",)


def checkpoint(path: Path, family: str) -> Path:
    if family in ("llama", "qwen2", "mistral"):
        return make_checkpoint(path, family)
    return make_family_checkpoint(path, family)


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows (i, i + d/2) to (2i, 2i+1), as the converter's LlamaModel.permute."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(hf: dict[str, Any], name: str) -> int | None:
    """The heads of a q_proj / k_proj weight or bias, None for any other tensor."""
    if ".q_proj." in name:
        return int(hf["num_attention_heads"])
    if ".k_proj." in name:
        return int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    return None


def _name_map(arch: Any, hf: dict[str, Any]) -> Any:
    return gguf.get_tensor_name_map(arch, hf["num_hidden_layers"])


def write_gguf(
    path: Path, hf_dir: Path, family: str, qtype: str, arch_name: str | None = None
) -> None:
    """The GGUF llama.cpp's converter makes of the checkpoint at hf_dir (CASES[family]'s
    arch), layer weights in `qtype`; `arch_name`: another general.architecture to write."""
    from safetensors.torch import load_file

    arch = getattr(gguf.MODEL_ARCH, CASES[family][0])
    hf = json.loads((hf_dir / "config.json").read_text())
    names = _name_map(arch, hf)
    writer = gguf.GGUFWriter(str(path), arch_name or gguf.MODEL_ARCH_NAMES[arch])
    for name, t in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        if name == "lm_head.weight" and arch.name in NO_OUTPUT:
            continue
        if arch.name in PERMUTED and (heads := _heads(hf, name)):
            t = _permute(t, heads)
        if arch.name in PLUS_ONE and name.endswith("norm.weight"):
            t = t + 1
        out = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert out is not None, name
        kind = "F32" if t.dim() == 1 else qtype if ".layers." in name else "Q8_0"
        add_tensor(writer, out, t, kind)
    close(writer)


def add_tensor(writer: Any, name: str, t: torch.Tensor, kind: str) -> None:
    """`t` written as `kind` (F32 or a quantization type's name)."""
    data = t.float().numpy()
    if kind != "F32":
        data = gguf.quants.quantize(data, Q[kind])
    writer.add_tensor(name, data, raw_dtype=Q[kind])


def close(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_on_the_files_values(path: Path, hf_dir: Path, family: str) -> Any:
    """HF's model with the GGUF's values (decoded by gguf-py) in HF's layout, the inputs of
    the layers the file quantizes rounded as ours are."""
    arch = getattr(gguf.MODEL_ARCH, CASES[family][0])
    hf = json.loads((hf_dir / "config.json").read_text())
    names = _name_map(arch, hf)
    values = {
        t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        for t in gguf.GGUFReader(str(path)).tensors
    }
    model = hf_model(hf_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            out = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if name == "lm_head.weight" and out not in values:
                out = "token_embd.weight"  # llama.cpp's output then
            value = values[out].reshape(p.shape)
            if arch.name in PERMUTED and (heads := _heads(hf, name)):
                value = _unpermute(value, heads)
            if arch.name in PLUS_ONE and name.endswith("norm.weight"):
                value = value - 1
            p.copy_(value)
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in _LINEARS]
    _round_inputs([*linears, model.lm_head])
    return model


# the most a weight moves in the file's blocks, of its largest magnitude: half a step (Q8_0:
# max |w| / 127 per block; Q4_1: its range / 15) and the fp16 rounding of scales and mins
ROUNDING = {"Q8_0": 0.005, "Q4_1": 0.08}


def assert_loads_as_the_checkpoint(hf_dir: Path, family: str, qtype: str) -> None:
    """The file loads to the weights our loader makes of the safetensors (which it permutes
    and offsets itself): F32 tensors exactly, quantized ones within their rounding (rows in
    another order would be off by the weights' own size)."""
    cfg = ModelConfig.from_model_dir(hf_dir)
    dense = load_model(hf_dir, cfg, torch.float32, "cpu")
    ours = load_model(hf_dir, cfg, torch.float32, "cpu", "gguf")
    for name, p in dense.named_parameters():
        if name == "lm_head.weight" and CASES[family][0] in NO_OUTPUT:
            p = dense.get_parameter("embed_tokens.weight")
        weight = ours.quantized.get(name)
        got = ours.get_parameter(name) if weight is None else weight.dequantize()
        if p.dim() == 1:
            assert torch.equal(got, p), name
            continue
        kind = qtype if name.startswith("layers.") else "Q8_0"
        err = (got - p).abs().max() / p.abs().max()
        assert err <= ROUNDING[kind], (name, err.item())


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", list(CASES))
def test_each_familys_gguf_matches_hf_on_the_files_values(tmp_path: Path, family: str) -> None:
    hf_dir = checkpoint(tmp_path / family, family)
    qtype = CASES[family][1]
    write_gguf(hf_dir / "model.gguf", hf_dir, family, qtype)
    assert_loads_as_the_checkpoint(hf_dir, family, qtype)
    prompts = random_prompts(4, (5, 30), TINY["vocab_size"], seed=21)
    model = hf_on_the_files_values(hf_dir / "model.gguf", hf_dir, family)
    expected = hf_greedy(model, prompts, 8, eos=None)
    llm = LLM(str(hf_dir), quantization="gguf", max_model_len=128)
    assert_greedy_matches(model, prompts, _generate(llm, prompts, 8), expected)
    weights = llm.engine.runner.model.quantized
    assert {w.bits for w in weights.values()} == ({8} if qtype == "Q8_0" else {4, 8})


@pytest.mark.parametrize(("family", "qtype"), [("llama", "Q4_0"), ("qwen2", "Q4_1")])
def test_prefill_past_the_kernels_rows(tmp_path: Path, family: str, qtype: str) -> None:
    """The file's blocks as they are: the first step's prefill rows pass KERNEL_MAX_ROWS
    (decoded weights, oneDNN), decode rows take the kernels."""
    hf_dir = checkpoint(tmp_path / family, family)
    write_gguf(hf_dir / "model.gguf", hf_dir, family, qtype)
    prompts = random_prompts(8, (10, 40), TINY["vocab_size"], seed=3)  # > 128 rows at once
    model = hf_on_the_files_values(hf_dir / "model.gguf", hf_dir, family)
    expected = hf_greedy(model, prompts, 10, eos=None)
    llm = LLM(str(hf_dir), quantization="gguf", max_model_len=128)
    assert_greedy_matches(model, prompts, _generate(llm, prompts, 10), expected)


@pytest.mark.parametrize("family", ["olmo2", "phi3"])
def test_two_tensor_parallel_ranks(tmp_path: Path, family: str) -> None:
    """Rows permuted on the whole tensor, then split: q/k norms over the whole projection
    (OLMo 2), fused q/k/v and gate/up with partial rotary (Phi-3)."""
    hf_dir = checkpoint(tmp_path / family, family)
    write_gguf(hf_dir / "model.gguf", hf_dir, family, CASES[family][1])
    prompts = random_prompts(4, (5, 30), TINY["vocab_size"], seed=22)
    model = hf_on_the_files_values(hf_dir / "model.gguf", hf_dir, family)
    expected = hf_greedy(model, prompts, 8, eos=None)
    with LLM(str(hf_dir), quantization="gguf", device="cpu", tensor_parallel_size=2) as llm:
        assert_greedy_matches(model, prompts, _generate(llm, prompts, 8), expected)


def test_the_table_covers_every_family_as_the_converter_writes_it() -> None:
    """Each served architecture is written as exactly one GGUF arch, permuted and offset as
    the converter does (the test's own account above)."""
    written = [hf for arch in gguf_loader.ARCHS.values() for hf in arch.hf]
    dense = [a for a, f in FAMILIES.items() if not (f.moe or f.mla or f.hybrid)]
    assert sorted(written) == sorted(dense + list(MOE_ARCHS))  # (test_gguf_moe)
    for name, arch in gguf_loader.ARCHS.items():
        assert arch.permuted == (name.upper() in PERMUTED), name
        assert arch.unit_offset == (name.upper() in PLUS_ONE), name
        assert all(FAMILIES[hf].unit_offset_norm == arch.unit_offset for hf in arch.hf), name


def test_unknown_or_mismatched_architectures_are_refused(tmp_path: Path) -> None:
    hf_dir = checkpoint(tmp_path / "qwen2", "qwen2")
    gguf_path = hf_dir / "model.gguf"
    write_gguf(gguf_path, hf_dir, "qwen2", "Q8_0", arch_name="falcon")
    with pytest.raises(ConfigError, match="holds a 'falcon' model; loading GGUF supports"):
        LLM(str(hf_dir), quantization="gguf")
    write_gguf(gguf_path, hf_dir, "qwen2", "Q8_0", arch_name="llama")  # permuted or not?
    with pytest.raises(
        ConfigError, match=r"a 'llama' model, config.json a Qwen2ForCausalLM .*converts to 'qwen2'"
    ):
        LLM(str(hf_dir), quantization="gguf")
    write_gguf(gguf_path, hf_dir, "qwen2", "Q5_0")
    with pytest.raises(ConfigError, match="is Q5_0: loading GGUF supports"):
        LLM(str(hf_dir), quantization="gguf")
