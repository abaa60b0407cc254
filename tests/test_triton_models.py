"""Whole models through the Triton-language kernels (run by the Triton interpreter) against the
pure-PyTorch reference backend: the layers' per-layer windows, ropes and logit soft-caps as the
decoder passes them (Llama, Mistral's window, Gemma 2's alternating soft-capped layers, Gemma
3's five windowed layers per global one at head dim 256). Kernel-level parity is in
test_triton_kernels.py."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from test_triton_kernels import small_tiles, to_head_major

from pagedllm.layers.attention import StepInputs
from pagedllm.layers.attention.torch_ref import TorchAttentionBackend

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="the triton package is missing: pip install -e '.[dev]'",
)


@pytest.fixture(scope="module")
def tk() -> ModuleType:
    module = importlib.import_module("pagedllm.layers.attention.triton_kernels")
    assert module.INTERPRETED
    return module


# tiny Gemmas: 2 alternates windowed and global layers, soft-capped (a cap that bends); 3 has 5
# windowed layers per global one, their own rope, head dim 256
GEMMAS: dict[str, dict[str, Any]] = {
    "gemma2": dict(num_hidden_layers=4, head_dim=64, attn_logit_softcapping=3.0),
    "gemma3": dict(num_hidden_layers=6, head_dim=256, num_attention_heads=2),
}


@pytest.fixture(scope="module")
def model_dirs(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    import transformers

    dirs = dict(checkpoints)
    for name, knobs in GEMMAS.items():
        config_cls = (
            transformers.Gemma2Config if name == "gemma2" else transformers.Gemma3TextConfig
        )
        model_cls = getattr(transformers, f"{name.capitalize()}ForCausalLM")
        config = config_cls(
            **{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, **knobs},
            num_key_value_heads=1,
            sliding_window=12,
            query_pre_attn_scalar=knobs["head_dim"],
            max_position_embeddings=512,
        )
        torch.manual_seed(0)
        dirs[name] = tmp_path_factory.mktemp(name)
        model_cls(config).save_pretrained(dirs[name])
    return dirs


def model_step(
    tokens: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    requests: list[tuple[int, int, int]],
    num_decodes: int,
) -> StepInputs:
    """A step of [(request, start position, new tokens)]: request r's tokens are row r of
    `tokens`, its blocks row r of `tables`."""
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in requests])
    owner = torch.cat([torch.full((n,), r) for r, _, n in requests])
    starts = [0]
    for _, _, n in requests:
        starts.append(starts[-1] + n)
    return StepInputs(
        input_ids=tokens[owner, positions],
        positions=positions,
        slot_mapping=tables[owner, positions // block_size] * block_size + positions % block_size,
        query_start_loc=starts,
        context_lens=[p + n for _, p, n in requests],
        block_tables=tables[[r for r, _, _ in requests]],
        num_decodes=num_decodes,
        logits_indices=torch.tensor(starts[1:]) - 1,
        block_size=block_size,
    )


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gemma3"])
def test_model_forward_matches_reference(tk: ModuleType, model_dirs: Any, arch: str) -> None:
    """Two steps of a tiny model: three prompts (one chunked), then a mixed batch of two
    decodes and the chunked prompt's second chunk over its cached prefix (past Mistral's
    24-token window and the Gemmas' 12). The logits and the caches of both backends agree."""
    from pagedllm.config import ModelConfig
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
    from pagedllm.model import load_model
    from pagedllm.model.decoder import ForwardContext
    from pagedllm.model.rope import rotary_table

    mcfg = ModelConfig.from_model_dir(model_dirs[arch])
    model = load_model(model_dirs[arch], mcfg, torch.float32, "cpu")
    tables_ = [rotary_table(rope, mcfg.head_dim, 512, 512) for rope in mcfg.ropes]
    block_size, num_blocks = 8, 24
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[:18]
    tables = tables.view(3, 6)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, mcfg.vocab_size, (3, 40), generator=gen)

    steps = [
        model_step(tokens, tables, block_size, [(0, 0, 12), (1, 0, 20), (2, 0, 7)], 0),
        model_step(tokens, tables, block_size, [(0, 12, 1), (2, 7, 1), (1, 20, 14)], 2),
    ]
    shape = (num_blocks, block_size, mcfg.num_kv_heads, mcfg.head_dim)
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(small_tiles(tk))):
        caches = [torch.zeros(backend.kv_cache_shape(*shape)) for _ in range(mcfg.num_layers)]
        logits = []
        for s in steps:
            rotary = tuple(t[s.positions].unsqueeze(1) for t in tables_)
            ctx = ForwardContext(rotary, caches, backend, backend.build_metadata(s))
            with torch.inference_mode():
                logits.append(model(s.input_ids, ctx, s.logits_indices))
        results.append((logits, caches))
    (ref_logits, ref_caches), (tri_logits, tri_caches) = results
    for expected, got in zip(ref_logits, tri_logits, strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for expected, got in zip(ref_caches, tri_caches, strict=True):
        torch.testing.assert_close(got, to_head_major(expected), atol=1e-5, rtol=0)
