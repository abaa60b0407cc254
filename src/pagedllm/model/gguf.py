"""Load a Llama-family GGUF file's weights, keeping quantized tensors as they are.

Q8_0 tensors become int8 weights in groups of 32, Q4_1 and Q4_0 int4 weights (layers.quant's
formats are those blocks, unpacked into separate arrays, so nothing is rounded); F32 / F16 /
BF16 tensors are loaded in the engine's dtype. Other quantization types (K-quants, ...) are
refused with the list of what is supported. The model's shape still comes from config.json.

NOTE: llama.cpp's converter stores q and k rows permuted to the interleaved rotary layout,
which is the layout our model uses (model/llama.py): they are taken as they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.config import ConfigError, ModelConfig
from pagedllm.layers.quant import QuantizedWeight

_NAMES = {
    "token_embd.weight": ("embed_tokens.weight", None),
    "output_norm.weight": ("norm.weight", None),
    "output.weight": ("lm_head.weight", None),
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm", None),
    "ffn_norm": ("post_attention_layernorm", None),
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", None),
}
_SKIPPED = ("rope_freqs.weight",)  # rotary frequencies: computed from config.json


def gguf_file(model_dir: Path) -> Path:
    files = sorted(model_dir.glob("*.gguf"))
    if len(files) != 1:
        found = "none" if not files else ", ".join(f.name for f in files)
        raise ConfigError(
            f"quantization 'gguf' needs exactly one *.gguf file in {str(model_dir)!r} "
            f"(found {found})"
        )
    return files[0]


def target(name: str) -> tuple[str, int | None] | None:
    """Our parameter name (and fused shard) of a GGUF tensor, None to skip it."""
    if name in _SKIPPED:
        return None
    if name in _NAMES:
        return _NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        ours, shard = _LAYER_NAMES[m.group(2)]
        return f"layers.{m.group(1)}.{ours}.{m.group(3)}", shard
    raise ConfigError(f"unexpected tensor {name!r} in the GGUF file")


def read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every tensor of the file by its GGUF name, one at a time (the file is mapped, not
    read whole): dense ones as fp32 tensors (N, K) or (K,), quantized ones as
    QuantizedWeight."""
    try:
        import gguf
    except ImportError as e:
        raise ConfigError("quantization 'gguf' needs the gguf package: pip install gguf") from e
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from e
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims inner first
        yield t.name, _tensor(gguf, t.tensor_type, np.asarray(t.data), shape, t.name)


def _tensor(gguf: Any, qtype: Any, data: np.ndarray, shape: tuple[int, ...], name: str) -> Any:
    types = gguf.GGMLQuantizationType
    if qtype in (types.F32, types.F16):
        return torch.from_numpy(data.astype(np.float32)).reshape(shape)
    if qtype == types.BF16:
        bits = torch.from_numpy(data.view(np.int16).copy()).reshape(shape)
        return bits.view(torch.bfloat16).float()
    decoders = {types.Q8_0: _q8_0, types.Q4_1: _q4_1, types.Q4_0: _q4_0}
    if qtype not in decoders:
        raise ConfigError(
            f"tensor {name!r} is {qtype.name}: loading GGUF supports F32, F16, BF16, Q8_0, "
            "Q4_0 and Q4_1 tensors"
        )
    n, k = shape
    if k % 32:
        raise ConfigError(f"tensor {name!r}: {k} inputs are not whole blocks of 32")
    blocks = np.ascontiguousarray(data).reshape(n, k // 32, -1)
    return decoders[qtype](blocks)


def _halves(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, (N, K / 32)."""
    raw = np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(raw.copy())


def _q8_0(blocks: np.ndarray) -> QuantizedWeight:  # block: fp16 d, 32 x int8
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(blocks.shape[0], -1)
    return QuantizedWeight(8, torch.from_numpy(q.copy()), _halves(blocks, 0).float())


def _q4_1(blocks: np.ndarray) -> QuantizedWeight:  # block: fp16 d, fp16 m, 16 bytes of nibbles
    q = np.ascontiguousarray(blocks[..., 4:]).reshape(blocks.shape[0], -1)
    return QuantizedWeight(4, torch.from_numpy(q.copy()), _halves(blocks, 0), _halves(blocks, 2))


def _q4_0(blocks: np.ndarray) -> QuantizedWeight:  # block: fp16 d, 16 bytes; w = d * (q - 8)
    q = np.ascontiguousarray(blocks[..., 2:]).reshape(blocks.shape[0], -1)
    scales = _halves(blocks, 0)
    return QuantizedWeight(4, torch.from_numpy(q.copy()), scales, scales * -8)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Quantized shards stacked along the output dim (a fused qkv or gate_up weight)."""
    first = parts[0]
    if any(p.bits != first.bits or p.group_size != first.group_size for p in parts):
        raise ConfigError("the shards of a fused weight are quantized differently")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
    return QuantizedWeight(
        first.bits,
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        mins,
    )


def check_shapes(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> None:
    if name == "embed_tokens.weight" and shape != (cfg.vocab_size, cfg.hidden_size):
        raise ConfigError(
            f"the GGUF embeddings are {shape}, config.json says "
            f"({cfg.vocab_size}, {cfg.hidden_size})"
        )
