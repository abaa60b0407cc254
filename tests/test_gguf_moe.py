"""GGUF files of mixture-of-experts models (model/gguf_moe.py) as llama.cpp's converter
writes them: every expert of a layer stacked in one tensor per projection, the router, the
shared expert and its 1-D gate. Oracle: transformers reading the same file
(`from_pretrained(..., gguf_file=...)`, which dequantizes it), the inputs of the layers the
file quantizes rounded as ours are (test_quantization). Every MoE arch transformers reads from
GGUF is covered (qwen2moe, qwen3moe); the other MoE families are refused clearly. Two
tensor-parallel ranks write one rank's tokens and log-probs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gguf_families import _generate, add_tensor, close
from test_quantization import _LINEARS, _round_inputs, _rounding_matmuls, assert_greedy_matches
from test_tensor_parallel import assert_same_tokens_and_log_probs

from conftest import TINY, hf_greedy, random_prompts
from families import make_family_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, ModelConfig
from pagedllm.distributed.shard import valid_sizes
from pagedllm.model.gguf import blocked_modules

gguf = pytest.importorskip("gguf")

# family -> (gguf-py's MODEL_ARCH, the type of the file's layer weights); embeddings and
# output in Q8_0, 1-D tensors in F32 (the router is quantized too: read dense)
CASES = {"qwen2_moe": ("QWEN2MOE", "Q8_0"), "qwen3_moe": ("QWEN3MOE", "Q4_1")}
SPARSE = {"qwen2_moe": dict(mlp_only_layers=[])}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$")


def write_gguf(path: Path, hf_dir: Path, family: str, qtype: str | None = None) -> None:
    """The checkpoint at hf_dir as the converter writes it: each layer's experts stacked per
    projection (E, out, in), the shared expert's gate as a 1-D tensor; its layers' weights in
    `qtype` (default: the family's CASES type)."""
    from safetensors.torch import load_file

    arch = getattr(gguf.MODEL_ARCH, CASES[family][0])
    qtype = qtype or CASES[family][1]
    hf = json.loads((hf_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(arch, hf["num_hidden_layers"])
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if m := _EXPERT.match(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = t
            continue
        out = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert out is not None, name
        tensors[out] = t.reshape(-1) if out.endswith("ffn_gate_inp_shexp.weight") else t
    for (layer, proj), per_expert in experts.items():
        stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])
        tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = stacked
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    for name, t in sorted(tensors.items()):
        kind = "F32" if t.dim() == 1 else qtype if name.startswith("blk.") else "Q8_0"
        add_tensor(writer, name, t, kind)
    close(writer)


def transformers_on_the_file(hf_dir: Path) -> Any:
    """transformers' model of the GGUF file (config.json's shape), the inputs of what ours
    multiplies quantized rounded as our kernels round them: linears, lm_head, the experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, gguf_file="model.gguf", config=config, dtype=torch.float32
    ).eval()
    model.set_experts_implementation("eager")  # its matmuls can be hooked
    modules = dict(model.named_modules())
    _round_inputs([m for n, m in modules.items() if n.rsplit(".", 1)[-1] in _LINEARS])
    _round_inputs([model.lm_head])
    for name, module in modules.items():
        if name.endswith(".experts"):
            _rounding_matmuls(module)
    return model


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's checkpoint with its GGUF file beside it; every layer sparse (llama.cpp's
    qwen2moe has no dense layers among sparse ones), the experts 64 wide: two blocks of 32
    inputs to each expert's down_proj, one for each of two tensor-parallel ranks."""
    root = tmp_path_factory.mktemp("gguf_moe")
    dirs = {}
    for family in CASES:
        widths = dict(moe_intermediate_size=64, **SPARSE.get(family, {}))
        dirs[family] = make_family_checkpoint(root / family, family, **widths)
        write_gguf(dirs[family] / "model.gguf", dirs[family], family)
    return dirs


@pytest.mark.parametrize("family", list(CASES))
def test_moe_gguf_matches_transformers_reading_the_file(
    moe_files: dict[str, Path], family: str
) -> None:
    hf_dir = moe_files[family]
    prompts = random_prompts(4, (5, 30), TINY["vocab_size"], seed=23)
    model = transformers_on_the_file(hf_dir)
    expected = hf_greedy(model, prompts, 8, eos=None)
    llm = LLM(str(hf_dir), quantization="gguf", max_model_len=128)
    assert_greedy_matches(model, prompts, _generate(llm, prompts, 8), expected)
    weights = llm.engine.runner.model.quantized
    bits = 8 if CASES[family][1] == "Q8_0" else 4
    experts = [w for n, w in weights.items() if ".experts_" in n]
    assert experts and {w.bits for w in experts} == {bits}
    assert not [n for n in weights if ".router." in n or ".shared_gate." in n]


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_moe_and_latent_attention_transformers_cannot_read_are_refused(
    tmp_path: Path, family: str
) -> None:
    """Mixtral (llama.cpp's llama arch with experts), gpt-oss and DeepSeek-V3 (latent
    attention): a clear error before the file is opened, naming what is read instead."""
    hf_dir = make_family_checkpoint(tmp_path / family, family)
    (hf_dir / "model.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"are not read: mixture-of-experts GGUF is read for"):
        LLM(str(hf_dir), quantization="gguf")


@pytest.mark.parametrize("family", list(CASES))
def test_two_tensor_parallel_ranks_write_one_ranks_tokens(
    moe_files: dict[str, Path], family: str
) -> None:
    """Each rank holds its half of every expert (gate/up rows, down_proj's inputs in whole
    blocks) and of the shared expert; the router and the shared gate whole. Through chunked
    prefill: one rank's greedy tokens, log-probs within 1e-4 (the activations a quantized
    weight meets are rounded per block of 32, which a rank holds whole: only sums reorder)."""
    prompts = random_prompts(4, (5, 30), TINY["vocab_size"], seed=23)
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    runs, held = [], []
    for world in (1, 2):
        with LLM(
            str(moe_files[family]),
            quantization="gguf",
            device="cpu",
            tensor_parallel_size=world,
            max_num_batched_tokens=16,
            block_size=4,
            max_model_len=128,
        ) as llm:
            runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, False))
            weights = llm.engine.runner.model.quantized
            held.append(
                (
                    weights["layers.0.mlp.experts_gate_up.weight"].qweight.shape[1],
                    weights["layers.0.mlp.experts_down.weight"].scales.shape[2],
                )
            )
    assert held == [(2 * 64, 2), (2 * 32, 1)]  # each expert's gate + up rows, down's blocks
    assert_same_tokens_and_log_probs(*runs)


def test_a_split_that_cuts_a_block_is_refused(tmp_path: Path) -> None:
    """Experts 32 wide do not split 2 ways between the file's blocks: refused before a worker
    starts, naming the sizes that work. The same model in F32 splits 2 or 4 ways."""
    hf_dir = make_family_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", moe_intermediate_size=32)
    cfg = ModelConfig.from_model_dir(hf_dir)
    write_gguf(hf_dir / "model.gguf", hf_dir, "qwen3_moe", "F32")
    assert blocked_modules(hf_dir) == frozenset()
    assert valid_sizes(cfg, 8) == [1, 2, 4]
    write_gguf(hf_dir / "model.gguf", hf_dir, "qwen3_moe")
    quantized = {"qkv_proj", "o_proj", "router", "experts_gate_up", "experts_down"}
    assert blocked_modules(hf_dir) == quantized  # (the split cares for o_proj and down's)
    assert valid_sizes(cfg, 8, blocked_modules(hf_dir)) == [1]
    message = (
        r"tensor_parallel_size 2 cannot split this model: its experts' width 32 does not split "
        r"2 ways into whole 32-wide blocks of its GGUF file \(16 inputs a rank\) "
        r"\(sizes that can: 1\)"
    )
    with pytest.raises(ConfigError, match=message):
        LLM(str(hf_dir), quantization="gguf", device="cpu", tensor_parallel_size=2)
