"""Load a HuggingFace checkpoint directory (safetensors only, never pickle) into our modules."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import ConfigError, ModelConfig
from pagedllm.layers.moe import quantize_experts
from pagedllm.layers.quant import QuantizedWeight, packs_on_cpu, quantize, quantize_int8
from pagedllm.model import arena, gguf, gguf_moe, kv_scales, layout, moe_layout
from pagedllm.model.decoder import CausalLM

if TYPE_CHECKING:
    from pagedllm.distributed.comm import TPGroup
    from pagedllm.distributed.shard import ShardPlan

# (dim, start, length): the part of a tensor a tensor-parallel rank holds (None: all of it)
Part = tuple[int, int, int] | None
# which part of a HF tensor, by its name, to read
Select = Callable[[str], Part]
# which part of our parameter (and fused shard) a rank holds
Slicer = Callable[[str, int | None], Part]


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no *.safetensors weights in {str(model_dir)!r} (pickled .bin checkpoints are "
            "never loaded: convert them to safetensors)"
        )
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ConfigError(f"weight files missing from {str(model_dir)!r}: {missing}")
    return files


def iter_checkpoint(
    files: list[Path], select: Select | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files; with `select`, only the part of each it names is read."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    part = None if select is None else select(name)
                    if part is None:
                        yield name, f.get_tensor(name)
                        continue
                    dim, start, length = part
                    index = [slice(None)] * (dim + 1)
                    index[dim] = slice(start, start + length)
                    yield name, _pad_rows(f.get_slice(name)[tuple(index)], dim, length)
        except SafetensorError as e:
            raise ConfigError(f"cannot read weights from {path}: {e}") from e


def _materialize(model: torch.nn.Module, device: str, dtype: torch.dtype) -> None:
    """Give every (meta) parameter uninitialized storage on `device` in `dtype`, for the
    loader to fill. NOTE: not `to_empty(...).to(dtype)`: torch's meta `empty_like` imports
    sympy (1.3 s of CPU at every engine start), and the detour through float32 holds the
    model twice."""
    made: dict[int, torch.nn.Parameter] = {}  # a parameter two modules share stays shared
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in made:  # a few stay fp32 whatever the dtype (DeepSeek's router)
                keep = getattr(p, "keep_fp32", False)
                empty = torch.empty(p.shape, device=device, dtype=torch.float32 if keep else dtype)
                made[id(p)] = torch.nn.Parameter(empty, requires_grad=p.requires_grad)
            setattr(module, name, made[id(p)])


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str,
    quantization: str | None = None,
    plan: ShardPlan | None = None,
    tp: TPGroup | None = None,
) -> CausalLM:
    """Build the model on `device` in `dtype` and fill every parameter from the checkpoint:
    its safetensors, quantized at load if `quantization` is "int8" or "int4" (layers.quant),
    or with "gguf" its GGUF file, whose quantized tensors are kept as they are. With a
    tensor-parallel `plan` (and its group `tp`), only this rank's shard is read and held."""
    with torch.device("meta"):
        model = CausalLM(cfg, plan, tp)
    _materialize(model, device, dtype)
    full, cfg = cfg, model.config  # the shard's sizes from here on
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    shard_sizes = layout.shard_sizes(cfg)
    loaded: set[tuple[str, int | None]] = set()
    slicer: Slicer | None = None
    if plan is not None:
        head_dim = full.head_dim
        slicer = lambda ours, shard: plan.slice_of(ours, shard, head_dim, full.qk_norm)  # noqa: E731
    if quantization == "gguf":
        _fill_from_gguf(model, params, shard_sizes, loaded, Path(model_dir), full, slicer)
    else:
        select = None if slicer is None else _by_hf_name(slicer, full)
        tensors = iter_checkpoint(weight_files(Path(model_dir)), select)
        for hf_name, tensor in tensors:
            if kv_scales.take(hf_name, tensor, model.kv_scales):
                continue
            for ours, shard, part in layout.unfuse(hf_name, tensor, full):
                where = slicer and layout.fused_in_checkpoint(hf_name, full) and slicer(ours, shard)
                if where:  # a fused tensor is read whole: this rank's part of its shard
                    dim, start, length = where
                    part = part.narrow(dim, start, length).contiguous()
                _copy(params, shard_sizes, loaded, hf_name, (ours, shard), part, cfg)
    _check_complete(params, shard_sizes, loaded, cfg)
    layout.adapt(model, cfg, from_gguf=quantization == "gguf")
    if quantization in ("int8", "int4"):
        _quantize(model, cfg, quantization)
    if torch.device(device).type == "cpu":
        if model.quantized and packs_on_cpu():  # for the AVX-512 VNNI kernels (not experts)
            model.quantized.update(
                (name, w.pack())
                for name, w in model.quantized.items()
                if name.split(".")[-2] not in moe_layout.EXPERT_MODULES
            )
        arena.adopt(model)  # the weights on huge pages: streamed faster by decode
    model.finalize_weights()
    return model.eval()


def _copy(
    params: dict[str, torch.nn.Parameter],
    shard_sizes: dict[str, list[int]],
    loaded: set[tuple[str, int | None]],
    source: str,
    target: tuple[str, int | None],
    tensor: torch.Tensor,
    cfg: ModelConfig,
) -> None:
    ours, shard = target
    if ours == "lm_head.weight" and cfg.tie_word_embeddings:
        return
    if ours not in params:
        raise ConfigError(f"unexpected tensor {source!r} in the checkpoint")
    dest = params[ours].data
    module = ours.split(".")[-2]
    if module in moe_layout.EXPERT_MODULES:  # per expert: shards of the flattened (E * rows)
        dest = dest.flatten(0, 1)
    if shard is not None:
        dest = dest.split(shard_sizes[module], dim=0)[shard]
    if dest.shape != tensor.shape:
        raise ConfigError(
            f"tensor {source!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
        )
    dest.copy_(tensor)
    loaded.add((ours, shard))


def _fill_from_gguf(
    model: CausalLM,
    params: dict[str, torch.nn.Parameter],
    shard_sizes: dict[str, list[int]],
    loaded: set[tuple[str, int | None]],
    model_dir: Path,
    full: ModelConfig,
    slicer: Slicer | None,
) -> None:
    """`full`: the whole model's config (the file's tensors are whole, in our layout)."""
    device, cfg = model.norm.weight.device, model.config
    shards: dict[str, dict[int | None, QuantizedWeight]] = {}
    for name, target, whole in gguf.read_model(model_dir, full):
        part = None if slicer is None else slicer(*target)
        tensor = whole if part is None else _narrow(whole, name, *part)
        if isinstance(tensor, torch.Tensor):
            _copy(params, shard_sizes, loaded, name, target, tensor, cfg)
            continue
        ours, shard = target
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ours not in params:
            raise ConfigError(f"unexpected tensor {name!r} in the GGUF file")
        shards.setdefault(ours, {})[shard] = tensor
    for ours, parts in shards.items():
        expected = shard_sizes.get(ours.split(".")[-2])
        order = [None] if expected is None else list(range(len(expected)))
        if set(parts) != set(order):
            continue  # reported as missing by _check_complete
        weight = gguf.concat([parts[s] for s in order])
        if ours.split(".")[-2] in moe_layout.EXPERT_MODULES:
            weight = gguf_moe.stack(weight, tuple(params[ours].shape), ours)
        elif weight.shape != tuple(params[ours].shape):
            raise ConfigError(
                f"GGUF tensor for {ours!r} has shape {weight.shape}, expected "
                f"{tuple(params[ours].shape)}"
            )
        model.set_quantized(ours, weight.to(device))
        loaded.update((ours, s) for s in order)


def _by_hf_name(slicer: Slicer, cfg: ModelConfig) -> Select:
    def select(name: str) -> Part:
        target = layout.target(name, cfg)
        if target is None or layout.fused_in_checkpoint(name, cfg):
            return None
        return slicer(*target)

    return select


def _narrow(
    whole: torch.Tensor | QuantizedWeight, name: str, dim: int, start: int, length: int
) -> torch.Tensor | QuantizedWeight:
    """A rank's part of a GGUF tensor (read whole)."""
    available = min(length, whole.shape[dim] - start)
    if isinstance(whole, torch.Tensor):
        return _pad_rows(whole.narrow(dim, start, available), dim, length)
    try:
        part = whole.narrow(dim, start, available)
    except ValueError as e:
        raise ConfigError(f"cannot split GGUF tensor {name!r} for tensor parallelism: {e}") from e
    if dim == 0 and part.shape[0] < length:
        part = gguf.concat([part, _zero_rows(part, length - part.shape[0])])
    return part


def _pad_rows(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`t` (a part along `dim`) with zero rows up to `length`: the last rank's part of a
    vocabulary padded to a multiple of the ranks (the rows of no token)."""
    if dim == 0 and (short := length - t.shape[0]):
        t = torch.cat([t, t.new_zeros(short, *t.shape[1:])])
    return t.contiguous()


def _zero_rows(w: QuantizedWeight, rows: int) -> QuantizedWeight:
    mins = None if w.mins is None else w.mins.new_zeros(rows, w.mins.shape[1])
    return QuantizedWeight(
        w.bits,
        w.qweight.new_zeros(rows, w.qweight.shape[1]),
        w.scales.new_zeros(rows, w.scales.shape[1]),
        mins,
    )


_DENSE_MLP = ("mlp.gate_up_proj", "mlp.down_proj")
_MOE_MLP = ("mlp.shared_gate_up", "mlp.shared_down")  # the experts' are stacked


def _attention_linears(cfg: ModelConfig) -> tuple[str, ...]:
    """Latent attention's are all but kv_b_proj, whose per-head blocks both ways of attending
    multiply dense (model/mla.py)."""
    if cfg.mla is None:
        return ("self_attn.qkv_proj", "self_attn.o_proj")
    q = ("q_proj",) if cfg.mla.q_lora_rank is None else ("q_a_proj", "q_b_proj")
    return tuple(f"self_attn.{p}" for p in (*q, "kv_a_proj_with_mqa", "o_proj"))


@torch.no_grad()
def _quantize(model: CausalLM, cfg: ModelConfig, method: str) -> None:
    """The decoder layers' linear weights in `method`; the embeddings (and an untied lm_head)
    in int8 per row, as llama.cpp keeps its token embeddings at 8 bits in 4-bit files."""
    names, experts = [], []
    for i in range(cfg.num_layers):
        sparse = bool(cfg.layer_moe) and cfg.layer_moe[i]
        mlp = _MOE_MLP[: 2 if cfg.moe and cfg.moe.shared_intermediate_size else 0]
        linear = cfg.hybrid is not None and cfg.hybrid.layer_linear[i]
        attn = ("self_attn.in_proj", "self_attn.o_proj") if linear else _attention_linears(cfg)
        for proj in (*attn, *(mlp if sparse else _DENSE_MLP)):
            names.append(f"layers.{i}.{proj}.weight")
        if sparse:
            experts += [f"layers.{i}.mlp.{m}.weight" for m in moe_layout.EXPERT_MODULES]
    try:
        for name in names:
            model.set_quantized(name, quantize(model.get_parameter(name).data, method))
        for name in experts:
            model.set_quantized(name, quantize_experts(model.get_parameter(name).data, method))
    except ValueError as e:
        raise ConfigError(f"cannot quantize this model to {method}: {e}") from e
    heads = ["embed_tokens.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
    for name in heads:
        model.set_quantized(name, quantize_int8(model.get_parameter(name).data))


def _check_complete(
    params: dict[str, torch.nn.Parameter],
    shard_sizes: dict[str, list[int]],
    loaded: set[tuple[str, int | None]],
    cfg: ModelConfig,
) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        fused = name.split(".")[-2]
        shards: list[int | None] = (
            list(range(len(shard_sizes[fused]))) if fused in shard_sizes else [None]
        )
        missing += [
            f"{name}[{s}]" if s is not None else name for s in shards if (name, s) not in loaded
        ]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ConfigError(f"the checkpoint is missing {len(missing)} tensors: {shown}")
