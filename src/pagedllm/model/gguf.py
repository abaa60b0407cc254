"""Load a GGUF file's weights as llama.cpp's converter writes them, for every family we serve,
keeping quantized tensors as they are.

Q8_0 tensors become int8 weights in groups of 32, Q4_1 and Q4_0 int4 weights (layers.quant's
formats are those blocks, unpacked into separate arrays, so nothing is rounded); F32 / F16 /
BF16 tensors are loaded in the engine's dtype. Other quantization types (K-quants, ...) are
refused with the list of what is supported. The model's shape still comes from config.json.

The file's `general.architecture` says how its converter wrote it (`ARCHS`; any other is
refused): for the archs llama.cpp rotates by consecutive pairs (its NORM rope: llama, granite,
smollm3) the converter permuted the q and k rows to the interleaved layout our model uses
(model/decoder.py), and they are taken as they are; for the others (its NEOX rope) they stay
half-split as in HF's checkpoint and are permuted here, with the q/k biases and q/k norm
weights, quantized ones too (blocks run along a row: permuting rows moves whole blocks).
Gemma's norm weights arrive as 1 + w, which is how we store them too. Mixture-of-experts
files (qwen2moe, qwen3moe: their stacked experts, router and shared expert) are read by
model/gguf_moe.py's hooks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.config import ConfigError, ModelConfig
from pagedllm.layers.quant import QuantizedWeight
from pagedllm.model import gguf_moe
from pagedllm.model.layout import shard_sizes
from pagedllm.model.rope import interleave_rows

Tensor = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class Arch:
    """How llama.cpp's converter writes one `general.architecture`."""

    hf: tuple[str, ...]  # the HF architectures it converts to this one
    permuted: bool  # q/k rows in interleaved pairs (else half-split, as HF's)
    unit_offset: bool = False  # norm weights stored as 1 + w
    fused: bool = False  # q/k/v in one `attn_qkv`, gate and up in one `ffn_up` (Phi-3)


ARCHS = {
    "llama": Arch(("LlamaForCausalLM", "MistralForCausalLM"), permuted=True),
    "granite": Arch(("GraniteForCausalLM",), permuted=True),
    "smollm3": Arch(("SmolLM3ForCausalLM",), permuted=True),
    "qwen2": Arch(("Qwen2ForCausalLM",), permuted=False),
    "qwen3": Arch(("Qwen3ForCausalLM",), permuted=False),
    "gemma2": Arch(("Gemma2ForCausalLM",), permuted=False, unit_offset=True),
    "gemma3": Arch(("Gemma3ForCausalLM",), permuted=False, unit_offset=True),
    "phi3": Arch(("Phi3ForCausalLM",), permuted=False, fused=True),
    "olmo2": Arch(("Olmo2ForCausalLM",), permuted=False),
    "qwen2moe": Arch(("Qwen2MoeForCausalLM",), permuted=False),
    "qwen3moe": Arch(("Qwen3MoeForCausalLM",), permuted=False),
}

_NAMES = {
    "token_embd.weight": ("embed_tokens.weight", None),
    "output_norm.weight": ("norm.weight", None),
    "output.weight": ("lm_head.weight", None),
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# the same names in every arch; which of them a file holds follows the family's norms and
# q/k norms (a tensor our model lacks is refused by the loader)
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm", None),
    "post_attention_norm": ("post_attention_layernorm", None),
    "ffn_norm": ("pre_feedforward_layernorm", None),
    "post_ffw_norm": ("post_feedforward_layernorm", None),
    "attn_q_norm": ("self_attn.q_norm", None),
    "attn_k_norm": ("self_attn.k_norm", None),
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_qkv": ("self_attn.qkv_proj", None),  # fused: split on load
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),  # gate and up fused where the arch is (Phi-3)
    "ffn_down": ("mlp.down_proj", None),
    **gguf_moe.LAYER_NAMES,  # experts, router, shared expert (model/gguf_moe.py)
}
# rotary frequencies and longrope factors: computed from config.json
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# (GGUF name, our parameter name and fused shard, the tensor in our layout)
Loaded = tuple[str, tuple[str, int | None], Tensor]


def gguf_file(model_dir: Path) -> Path:
    files = sorted(model_dir.glob("*.gguf"))
    if len(files) != 1:
        found = "none" if not files else ", ".join(f.name for f in files)
        raise ConfigError(
            f"quantization 'gguf' needs exactly one *.gguf file in {str(model_dir)!r} "
            f"(found {found})"
        )
    return files[0]


def read_model(model_dir: Path, cfg: ModelConfig) -> Iterator[Loaded]:
    """Every weight of the directory's GGUF file in our layout, one at a time (the file is
    mapped, not read whole): dense ones as fp32 tensors, quantized ones as QuantizedWeight;
    fused ones (Phi-3) as their shards. `cfg`: the whole model's (not a tensor-parallel
    rank's)."""
    gguf_moe.refuse_unread(cfg)
    gguf, reader, path = _open(model_dir)
    arch = architecture(reader, cfg, path.name)
    # no `output` tensor (Gemma's converter never writes one): the embeddings project the
    # output too, as llama.cpp takes them
    names = {t.name for t in reader.tensors}
    head_from_embd = not cfg.tie_word_embeddings and "output.weight" not in names
    for t in reader.tensors:
        target = _target(t.name, arch)
        if target is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims inner first
        decoded = gguf_moe.stacked_shape(shape) if len(shape) == 3 else shape
        tensor = _tensor(gguf, t.tensor_type, np.asarray(t.data), decoded, t.name)
        for ours, shard, part in _unfuse(t.name, target, tensor, cfg):
            yield t.name, (ours, shard), _to_layout(ours, shard, part, cfg, arch)
        if head_from_embd and t.name == "token_embd.weight":
            yield t.name, ("lm_head.weight", None), tensor


def _open(model_dir: Path) -> tuple[Any, Any, Path]:
    """gguf-py, a reader of the directory's GGUF file (mapped, not read) and its path."""
    try:
        import gguf
    except ImportError as e:
        raise ConfigError("quantization 'gguf' needs the gguf package: pip install gguf") from e
    path = gguf_file(model_dir)
    try:
        return gguf, gguf.GGUFReader(str(path)), path
    except (ValueError, OSError) as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from e


def blocked_modules(model_dir: Path) -> frozenset[str]:
    """Our modules (`o_proj`, `experts_down`, ...) that the directory's GGUF file holds in
    quantized blocks of 32 inputs, which a tensor-parallel rank's part cannot cut."""
    gguf, reader, _ = _open(model_dir)
    types = gguf.GGMLQuantizationType
    dense = (types.F32, types.F16, types.BF16)
    found = set()
    for t in reader.tensors:
        m = _LAYER.match(t.name)
        if m and m.group(2) in _LAYER_NAMES and t.tensor_type not in dense:
            found.add(_LAYER_NAMES[m.group(2)][0].split(".")[-1])
    return frozenset(found)


def architecture(reader: Any, cfg: ModelConfig, file: str) -> Arch:
    """The file's `general.architecture`, known and the one config.json's converts to."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ConfigError(f"GGUF file {file} has no general.architecture")
    name = bytes(field.parts[field.data[0]]).decode("utf-8")
    if name not in ARCHS:
        raise ConfigError(
            f"GGUF file {file} holds a {name!r} model; loading GGUF supports the "
            f"architectures {', '.join(ARCHS)}"
        )
    if cfg.architecture not in ARCHS[name].hf:
        expected = [a for a, arch in ARCHS.items() if cfg.architecture in arch.hf]
        raise ConfigError(
            f"GGUF file {file} holds a {name!r} model, config.json a {cfg.architecture} "
            f"(which llama.cpp converts to {' or '.join(map(repr, expected))})"
        )
    return ARCHS[name]


def _target(name: str, arch: Arch) -> tuple[str, int | None] | None:
    """Our parameter name and fused shard of a GGUF tensor (shard None for a qkv_proj or
    gate_up_proj: fused in the file), None to skip it."""
    if name in _SKIPPED:
        return None
    if name in _NAMES:
        return _NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        ours, shard = _LAYER_NAMES[m.group(2)]
        if arch.fused and m.group(2) == "ffn_up":
            shard = None
        return f"layers.{m.group(1)}.{ours}.{m.group(3)}", shard
    raise ConfigError(f"unexpected tensor {name!r} in the GGUF file")


def _unfuse(
    name: str, target: tuple[str, int | None], tensor: Tensor, cfg: ModelConfig
) -> Iterator[tuple[str, int | None, Tensor]]:
    """(our name, shard, tensor): a fused q/k/v or gate/up tensor as its shards."""
    ours, shard = target
    if ours.split(".")[-2] in gguf_moe.SPLIT:
        yield from gguf_moe.split(ours, shard, tensor, cfg)
        return
    sizes = shard_sizes(cfg).get(ours.split(".")[-2])
    if sizes is None or shard is not None:
        yield ours, shard, tensor
        return
    if tensor.shape[0] != sum(sizes):
        raise ConfigError(
            f"GGUF tensor {name!r} has {tensor.shape[0]} rows, config.json gives {sum(sizes)}"
        )
    start = 0
    for i, size in enumerate(sizes):
        yield ours, i, tensor.narrow(0, start, size)
        start += size


def _to_layout(ours: str, shard: int | None, t: Tensor, cfg: ModelConfig, arch: Arch) -> Tensor:
    """q / k rows (weights, biases and q/k norm weights) permuted to the interleaved rotary
    order where the file holds them half-split."""
    module = ours.split(".")[-2]
    rotated = (module == "qkv_proj" and shard in (0, 1)) or module in ("q_norm", "k_norm")
    rows, hd = t.shape[0], cfg.head_dim
    if arch.permuted or not rotated or rows % hd:  # (a wrong shape is reported by the loader)
        return t
    index = interleave_rows(torch.arange(rows), rows // hd, hd, cfg.rotary_dim)
    if isinstance(t, torch.Tensor):
        return t[index]
    mins = None if t.mins is None else t.mins[index]
    return QuantizedWeight(t.bits, t.qweight[index], t.scales[index], mins)


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
