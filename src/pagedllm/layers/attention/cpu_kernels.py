"""C++ paged decode attention for the CPU (src/pagedllm/csrc/), compiled on first use with
`load_inline`.

The kernel reads each request's keys/values straight from the paged cache (no gather into a
padded tensor). Tasks are (request, KV head) pairs spread over the threads by
`at::parallel_for`; a thread attends its consecutive tasks of one request in a single pass over
the keys (each cache slot read as one contiguous run), and each key is loaded once for the
`group` query heads of its KV head (and each value once for up to 4 of them); the next tile's
slots are prefetched while a tile is scored (the cache is paged: the hardware prefetcher
cannot follow it). With fewer tasks than twice the threads (batch 1: SmolLM2's 3 KV heads
on 2 threads) each request's keys are cut instead into one run per thread (a tile at least),
each attended for all heads, and the runs' softmax sums merged (flash-decoding). Online
softmax in fp32 over tiles of 32 keys, each tile's scores soft-capped first where the layer
has a cap (one branch per tile, nothing in the dot products); attention sinks join each head's
denominator once, when its output is normalized (nothing in the key loop); fp32, bf16 and
fp16 caches, accumulation in fp32, head_dim a multiple of 16 up to 256; an int8 cache
(kv_cache_dtype.py: each row's fp32 scale after its values) with queries of any of those
dtypes, each key's scale applied to its score and each value's to its probability. `write_kv`
stores a step's new keys and values in their slots (one copy per token; into an int8 cache,
each row quantized as layers/attention/kv_quant.py does, to the same bits).

The same extension holds the decoder layers' fused elementwise ops (`rms_norm`,
`fused_add_rms_norm`, `silu_and_mul`, `rotary_embedding` in place on q and k): one pass per
row in fp32, rounded once to the dtype, rows spread over threads only above ~16k elements (a
decode of one row stays on the caller's thread). Their wrappers fall back to plain PyTorch for what the kernels do not handle
(no extension, another device or dtype, a layout that cannot be written in place).

Built with `-O3 -march=native`, so the extension's name carries a hash of the source, the
flags, the torch version and the CPU's identity: another CPU (or source) compiles its own.
If the build fails (no compiler, no `ninja`, ...) `load_kernels()` returns None once with a
warning and callers fall back to pure PyTorch; `PAGEDLLM_CPU_KERNEL=0` forces that fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import kv_quant

logger = logging.getLogger(__name__)


def _put_venv_bin_on_path() -> None:
    """The build runs `ninja` from PATH; pip installs it next to this interpreter, which a
    virtual environment used without activation (e.g. `.venv/bin/python ...`) lacks on PATH."""
    bindir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


_put_venv_bin_on_path()

MAX_GROUP = 16  # query heads per KV head
MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno") + (
    # gcc tunes recent x86 for 256-bit vectors; the kernel's 16-lane vectors want 512
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)
_LDFLAGS = ("-fopenmp",)  # resolves to the libgomp that torch already loaded (same soname)

# The C++ sources (src/pagedllm/csrc/): one translation unit, the kernels after their shared
# SIMD headers (each source includes what it needs; each is included once).
CSRC = Path(__file__).resolve().parents[2] / "csrc"
_SOURCES = (
    "paged_attention.cpp",
    "elementwise.cpp",
    "gemv.cpp",
    "qgemv_row.cpp",
    "qgemv_packed.cpp",
    "qgemv.cpp",
    "moe_gemm.cpp",
    "moe.cpp",
    "lora.cpp",  # before decoder.cpp, whose decode_layers adds a step's LoRA deltas by it
    "decoder_common.cpp",  # the linears and norms of the one-call step (the next two)
    "mla_decode.cpp",
    "decoder.cpp",
    "gated_delta.cpp",
)
# the functions the extension exports (part of its name: a build never lacks one)
_FUNCTIONS = (
    "paged_decode_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "argmax_rows",
    "rotary_embedding",
    "write_kv",
    "linear_dense",
    "linear_int8",
    "linear_int4",
    "dequantize_int8",
    "dequantize_int4",
    "packed_rows",
    "decode_layers",
    "fused_moe",
    "gated_delta_decode",
    "gdn_conv_update",
    "lora_bgmv",
)


def _source_text() -> list[str]:
    return [(CSRC / name).read_text(encoding="utf-8") for name in _SOURCES]


_lock = threading.Lock()
_state: dict[str, Any] = {}  # "module" (the extension or None) once the first load was tried


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def extension_name() -> str:
    headers = [p.read_text(encoding="utf-8") for p in sorted(CSRC.glob("*.h"))]
    parts = [*headers, *_source_text(), *_FUNCTIONS, *_CFLAGS, *_LDFLAGS]
    parts += [torch.__version__, _cpu_identity()]
    key = "\n".join(parts)
    return "pagedllm_cpu_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _build() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=extension_name(),
        cpp_sources=_source_text(),
        functions=list(_FUNCTIONS),
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),  # copies: load_inline appends to them
        extra_include_paths=[str(CSRC)],
        verbose=False,
    )


def load_kernels() -> Any | None:
    """The compiled extension (built or loaded from the torch extensions cache on the first
    call), or None if it cannot be built or `PAGEDLLM_CPU_KERNEL=0`."""
    with _lock:
        if "module" not in _state:
            _state["module"] = None
            if os.environ.get("PAGEDLLM_CPU_KERNEL", "1") == "0":
                logger.info("PAGEDLLM_CPU_KERNEL=0: CPU attention kernel disabled")
            else:
                try:
                    _state["module"] = _build()
                except Exception as e:  # any build failure means: use the fallback
                    logger.warning("CPU attention kernel unavailable (%s); using PyTorch", e)
        return _state["module"]


def kernel_available() -> bool:
    return load_kernels() is not None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these shapes/dtypes (else use the PyTorch path)."""
    int8 = kv_cache.dtype == torch.int8  # rows of head_dim values and their fp32 scale
    return (
        q.device.type == "cpu"
        and (int8 or kv_cache.dtype == q.dtype)
        and kv_cache.is_contiguous()
        and kv_cache.shape[4] == q.shape[2] + (4 if int8 else 0)
        and supports_shape(q.dtype, q.shape[1], kv_cache.shape[3], q.shape[2])
    )


def supports_shape(dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel attends heads of this dtype and shape."""
    return (
        dtype in _DTYPES
        and num_heads % kv_heads == 0
        and num_heads // kv_heads <= MAX_GROUP
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
    )


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its paged context, written into `out`.

    out: contiguous (D, H, head_dim), dtype of q; q: (D, H, head_dim), any strides with a
    contiguous last dim; kv_cache: contiguous (num_blocks, block_size, 2, kv_heads, head_dim)
    of q's dtype, or int8 (..., head_dim + 4), each row's fp32 scale after its values;
    block_tables: int64 (>= D, max_blocks) with contiguous rows; context_lens: int64 (D,), the
    tokens in the cache including the new one. Only keys at positions >= ctx - sliding_window
    are attended if a window is given; with `softcap` the scaled scores are capped as
    cap * tanh(s / cap); `sinks`, contiguous fp32 (H,), join each head's softmax denominator
    (`AttnLayer.sinks`). Raises RuntimeError if the kernel is unavailable.
    """
    module = load_kernels()
    if module is None:
        raise RuntimeError("CPU attention kernel unavailable (see the logged build error)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    module.paged_decode_attention(
        out,
        q,
        kv_cache,
        block_tables,
        context_lens,
        float(scale),
        sliding_window or 0,
        float(softcap or 0.0),
        sinks,
    )
    return out


# ---- Fused elementwise ops of the decoder layers (the model calls these on any device: they
# run the kernel for CPU tensors of a supported dtype, else plain PyTorch).


def kernel_module() -> Any | None:
    try:
        return _state["module"]
    except KeyError:
        return load_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`(x * rsqrt(mean(x^2, -1) + eps)) * weight` over the last dim, in fp32, rounded once to
    x's dtype (transformers' LlamaRMSNorm in fp32). A new tensor."""
    module = kernel_module()
    out = None if module is None else module.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps) if out is None else out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = residual + x; x = rms_norm(residual, weight, eps)`: returns (x, residual).

    Consumes its inputs: the kernel overwrites them in place (and returns them), the PyTorch
    fallback returns new tensors, so use the returned ones. The norm is that of the sum rounded
    to the dtype, as unfused."""
    module = kernel_module()
    if module is not None and module.fused_add_rms_norm(x, residual, weight, eps):
        return x, residual
    residual = residual + x
    return F.rms_norm(residual, weight.shape, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `gate, up = gate_up.chunk(2, -1)`, in fp32, rounded once."""
    module = kernel_module()
    out = None if module is None else module.silu_and_mul(gate_up)
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


def rotary_embedding(qk: torch.Tensor, rotary: torch.Tensor) -> None:
    """Rotates `qk` (N, heads, head_dim) in place: each head's interleaved pairs
    (x[2i], x[2i+1]) as complex numbers times `rotary` (N, 1, head_dim / 2) complex64, in fp32,
    rounded once to qk's dtype."""
    module = kernel_module()
    n, heads, head_dim = qk.shape
    if module is not None and module.rotary_embedding(qk, torch.view_as_real(rotary), heads):
        return
    rotated = torch.view_as_complex(qk.float().view(n, heads, head_dim // 2, 2)) * rotary
    qk.copy_(torch.view_as_real(rotated).view(n, heads, head_dim))


def write_kv(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`kv_cache` (num_blocks, block_size, 2, kv_heads, head_dim) gets each token's keys and
    values `kv` (N, 2, kv_heads, head_dim) in its slot (block * block_size + offset)."""
    module = kernel_module()
    if module is None or not module.write_kv(kv, kv_cache, slot_mapping):
        kv_quant.write(kv_cache, slot_mapping, kv)
