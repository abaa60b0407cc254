"""Checkpoint loading: sharded weights, dtypes, rope scalings vs transformers, and the errors a
user gets for a model directory that cannot be served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY, hf_greedy, hf_model, make_checkpoint, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, RopeConfig


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    shutil.copy(checkpoints["llama"] / "tokenizer.json", sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompts = random_prompts(3, (5, 20), TINY["vocab_size"], seed=11)
    assert greedy(LLM(str(sharded)), prompts, 8) == greedy(
        LLM(str(checkpoints["llama"])), prompts, 8
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_load_and_mostly_agree(
    dtype: torch.dtype, checkpoints: dict[str, Path]
) -> None:
    llm = LLM(str(checkpoints["qwen2"]), dtype=str(dtype).removeprefix("torch."))
    assert llm.engine.runner.model.embed_tokens.weight.dtype == dtype
    assert llm.engine.runner.kv_caches[0][0].dtype == dtype
    prompts = random_prompts(4, (5, 20), TINY["vocab_size"], seed=12)
    fp32 = greedy(LLM(str(checkpoints["qwen2"]), dtype="float32"), prompts, 6)
    half = greedy(llm, prompts, 6)
    # low precision may flip a near-tie late on; the first tokens must agree
    assert [h[0] for h in half] == [f[0] for f in fp32]


def test_auto_dtype_follows_checkpoint(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    path = copy_ckpt(checkpoints["llama"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    cfg.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(cfg))
    assert LLM(str(path)).engine.config.dtype == torch.bfloat16
    assert LLM(str(path), dtype="float32").engine.config.dtype == torch.float32


# rope tables against transformers' own, rope type by rope type: tests/test_rope.py
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        # the context stretched 4x from 16; cos and sin scaled by 3 (default: 1 + 0.1 ln 4,
        # too close to 1 for a tiny random model's greedy tokens to feel it)
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "attention_factor": 3.0,
        },
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_scaled_rope_parity_past_trained_context(tmp_path: Path, rope: dict) -> None:
    # yarn: max_position_embeddings the stretched context (16 x 4), as DeepSeek-V3 writes it
    stretched = rope["rope_type"] != "yarn"
    path = make_checkpoint(
        tmp_path / rope["rope_type"],
        "llama",
        max_position_embeddings=32 if stretched else 64,
        rope_scaling=rope,
    )
    llm = LLM(str(path))
    assert llm.engine.config.scheduler.max_model_len == 64
    prompts = random_prompts(4, (10, 28), TINY["vocab_size"], seed=13)
    # prompts within the trained context, generation well past it
    assert greedy(llm, prompts, 30) == hf_greedy(hf_model(path), prompts, 30, eos=None)


def test_generation_config_eos(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    path = copy_ckpt(checkpoints["llama"], tmp_path / "m")
    prompts = random_prompts(6, (5, 30), TINY["vocab_size"], seed=14)
    free_run = greedy(LLM(str(path)), prompts, 20)
    eos = free_run[0][2]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eos]}))
    llm = LLM(str(path))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == free_run[0][:3]
    assert outs[0].outputs[0].finish_reason == "stop"
    for out, ref in zip(outs, free_run, strict=True):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert out.outputs[0].token_ids == ref[:cut]
    # ignore_eos runs to max_tokens
    assert greedy(llm, prompts[:1], 20) == free_run[:1]


def test_text_prompt_and_output_text(checkpoints: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoints["llama"] / "tokenizer.json"))
    llm = LLM(str(checkpoints["llama"]))
    out = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.prompt == "Once upon a time"
    assert out.prompt_token_ids == tok.encode("Once upon a time").ids
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


# --- errors -------------------------------------------------------------------------------


def test_unknown_architecture(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    path = copy_ckpt(checkpoints["llama"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(path))


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"missing config\.json"):
        LLM(str(tmp_path / "empty"))


def test_missing_weights(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    path = copy_ckpt(checkpoints["llama"], tmp_path / "m")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"pickle is never loaded")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weights"):
        LLM(str(path))


def test_missing_tensor(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    path = copy_ckpt(checkpoints["llama"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing 1 tensors: layers\.1\.self_attn\.qkv_proj"):
        LLM(str(path))


def test_corrupt_weights(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    path = copy_ckpt(checkpoints["llama"], tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="cannot read weights"):
        LLM(str(path))


def test_wrong_shape(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    path = copy_ckpt(checkpoints["llama"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="has shape"):
        LLM(str(path))


def test_bad_dtype_and_rope(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="unsupported dtype"):
        LLM(str(checkpoints["llama"]), dtype="int8")
    with pytest.raises(ConfigError, match="rope scaling type 'proportional'"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}})


def test_prompt_errors(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["llama"]), max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", params, use_tqdm=False)
    with pytest.raises(ValueError, match="context is 64 tokens"):
        llm.generate({"prompt_token_ids": [5] * 64}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        llm.generate(
            {"prompt_token_ids": [5] * 60},
            SamplingParams(temperature=0, max_tokens=10),
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 384\)"):
        llm.generate({"prompt_token_ids": [5, 384]}, params, use_tqdm=False)
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        LLM(str(checkpoints["llama"]), max_model_len=10_000)
    # a failed batch leaves nothing behind, and the engine still works
    with pytest.raises(ValueError):
        llm.generate(
            [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], params, use_tqdm=False
        )
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert len(greedy(llm, [[5, 6, 7]], 4)[0]) == 4


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(temperature=0, max_tokens=0)
    with pytest.raises(ValueError, match="temperature must be non-negative"):
        SamplingParams(temperature=-1.0)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_cpu_weights_in_one_huge_page_mapping(
    quantization: str | None, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """model/arena.py: every weight the CPU forward reads (parameters, tied ones once, and
    quantized tensors) lies in one mapping, each on a cache line; and the
    outputs are those of the model as loaded (the tensors were moved, not changed)."""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no madvise(MADV_HUGEPAGE) here")
    llm = LLM(str(checkpoints["llama"]), quantization=quantization)
    model = llm.engine.runner.model
    tensors = {p.data_ptr(): p for p in model.parameters() if p.numel()}
    for q in model.quantized.values():
        for t in (q.qweight, q.scales, q.mins):
            if t is not None:
                tensors[t.data_ptr()] = t
    assert len(tensors) > 10 and (quantization is None) == (not model.quantized)
    ptrs = sorted(tensors)
    assert all(p % 64 == 0 for p in ptrs)
    end = ptrs[-1] + tensors[ptrs[-1]].numel() * tensors[ptrs[-1]].element_size()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    assert end - ptrs[0] < size + 64 * len(tensors)  # one region, nothing else in it
    prompts = random_prompts(3, (5, 20), TINY["vocab_size"], seed=13)
    from pagedllm.model import arena

    moved = greedy(llm, prompts, 8)
    monkeypatch.setattr(arena, "adopt", lambda model: 0)
    assert greedy(LLM(str(checkpoints["llama"]), quantization=quantization), prompts, 8) == moved


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_cpu_kv_caches_in_one_huge_page_mapping(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """model/arena.zeros: a CPU engine's KV caches, one per layer, lie back to back in one
    zeroed mapping, which Linux backs with 2 MiB pages where transparent huge pages are on
    (torch's own allocations get them only with THP `always`); generation is the same as on
    caches from torch.zeros."""
    import mmap

    from pagedllm.model import arena

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no madvise(MADV_HUGEPAGE) here")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text().split("[")[1].split("]")[0] if thp.exists() else "never"
    llm = LLM(str(checkpoints["llama"]), kv_cache_memory=64 << 20)
    caches = llm.engine.runner.kv_caches
    size = caches[0].numel() * caches[0].element_size()
    assert len(caches) == TINY["num_hidden_layers"] and size % 64 == 0
    assert [c.data_ptr() - caches[0].data_ptr() for c in caches] == [
        i * size for i in range(len(caches))
    ]
    assert not any(c.any() for c in caches)
    if mode != "never":
        assert _anon_huge_kib(caches[0].data_ptr()) >= 2048
    prompts = random_prompts(3, (5, 20), TINY["vocab_size"], seed=14)
    on_huge_pages = greedy(llm, prompts, 8)

    def torch_zeros(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]

    monkeypatch.setattr(arena, "zeros", torch_zeros)
    plain = LLM(str(checkpoints["llama"]), kv_cache_memory=64 << 20)
    if mode == "madvise":
        assert _anon_huge_kib(plain.engine.runner.kv_caches[0].data_ptr()) == 0
    assert greedy(plain, prompts, 8) == on_huge_pages
