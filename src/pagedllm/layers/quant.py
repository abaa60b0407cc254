"""Weight-only quantization: int8 and int4 weights, and the linear layer over them.

Two formats, both with groups along the input dim (K) of a (N, K) weight:
- int8: `qweight` int8 (N, K), `scales` fp32 (N, K / group): w = q * scale. Symmetric;
  `quantize_int8` makes one group per output channel (group = K); GGUF's Q8_0 is group 32.
- int4: `qweight` uint8 (N, K / 2), `scales` and `mins` fp16 (N, K / 32): w = q * scale + min,
  q in 0..15 (affine). Each group of 32 is packed as GGUF's Q4_1 (byte j: element j in the low
  nibble, element j + 16 in the high one), so a Q4_1 (or Q4_0: min = -8 * scale) tensor is
  this format as it is.
Either can be packed (`QuantizedWeight.pack`: 3-D tensors, sixteen rows side by side) for the
AVX-512 VNNI kernels of csrc/qgemv_packed.cpp; `load_model` packs a CPU model's weights where
the extension takes them (`packs_on_cpu`), and those kernels then run at any number of rows.

`linear(x, w, bias)` takes a dense tensor or a `QuantizedWeight`. On the CPU, up to
`KERNEL_MAX_ROWS` rows of x (decode, small prefill chunks) go to the C++ kernels, which read
every weight byte once per call on all threads: csrc/gemv.cpp for dense weights (each group
converted to fp32 in registers), csrc/qgemv.cpp for quantized ones (integer dot products with
x rounded to int8 in groups of 32, as llama.cpp does). More rows decode the weight once to x's
dtype for the dense matmul. Elsewhere (CUDA) the weight is decoded and multiplied by torch. A
quantized weight always meets x rounded the same way (`round_activations`), on every path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import cpu_kernels

INT4_GROUP = 32
PACK_ROWS = 16  # rows of a packed weight side by side (`QuantizedWeight.pack`)
ACTIVATION_GROUP = 32  # activations meet quantized weights as int8 in groups of this many


def _kernel_max_rows(flags: set[str]) -> dict[str, int | None]:
    """Up to how many rows of x a CPU linear runs the C++ kernels (one pass over the weights
    per call); past it, oneDNN's matmul (on the weight decoded once, for quantized weights) is
    faster. Where depends on the CPU (benchmarks/gemv_bench.py, kernel vs fallback columns):
    - AVX2 only (AMD EPYC Zen 3): up to 64 rows, fp32 and 16-bit; past it a 16-bit weight is
      multiplied in fp32 (`FAST_16BIT_MATMUL`), 1.4x the kernel at 128 rows and 2.1-2.5x at
      256-512 (oneDNN's own bf16 matmul has no fast path there: 3-4x slower than the kernel);
    - AVX-512 (Intel Xeon): the kernel's 4 x 4 tiles keep up with PyTorch's fp32 GEMM to
      about 48 rows (1.15x at 32, 0.94x at 64), and with AVX-512 BF16 / AMX oneDNN's bf16
      matmul passes the kernel past 8 rows (2x at 32);
    - quantized weights: up to 128 rows on both (the fallback decodes the weight per call);
      packed ones (AVX-512 VNNI) always: 4-5x faster than the fallback at 128 and 256 rows,
      and 1.6x faster than oneDNN on the weight decoded beforehand."""
    avx512 = "avx512f" in flags
    return {
        "fp32": 48 if avx512 else 64,
        "quantized": 128,
        "packed": None,
        "16-bit": 8 if _fast_16bit(flags) else 64,
    }


def _fast_16bit(flags: set[str]) -> bool:
    """Whether oneDNN multiplies bf16 / fp16 matrices natively on this CPU (AVX-512 BF16, AMX).
    Elsewhere it emulates them, 3-4x slower than the fp32 matmul over the same shapes."""
    return bool(flags & {"avx512_bf16", "amx_bf16"})


_FLAGS = cpu_kernels.cpu_flags()
KERNEL_MAX_ROWS = _kernel_max_rows(_FLAGS)
# False: past the kernels' rows, a CPU matmul with 16-bit x runs in fp32 (`_matmul`)
FAST_16BIT_MATMUL = _fast_16bit(_FLAGS)


@dataclass(frozen=True)
class QuantizedWeight:
    """A (N, K) weight in one of this module's formats (`bits` 8 or 4)."""

    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        """Sixteen rows side by side for the AVX-512 VNNI kernels (`pack`)."""
        return self.qweight.dim() == 3

    @property
    def shape(self) -> tuple[int, int]:
        if self.packed:
            blocks, chunks, _ = self.qweight.shape
            return blocks * PACK_ROWS, chunks * (4 if self.bits == 8 else 8)
        n, packed = self.qweight.shape
        return n, packed * (8 // self.bits)

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        if self.packed and torch.device(device).type != "cpu":
            return self.unpack().to(device)
        mins = None if self.mins is None else self.mins.to(device)
        return replace(
            self, qweight=self.qweight.to(device), scales=self.scales.to(device), mins=mins
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight in `dtype`, each value computed in fp32."""
        w = self.unpack()
        return _decode(w.qweight, w.scales, w.mins, w.bits).to(dtype)

    def pack(self) -> QuantizedWeight:
        """This weight with each block of 16 rows side by side, as csrc/qgemv_packed.cpp reads
        it (its layout is described there); N must be a multiple of 16."""
        n, k = self.shape
        b = n // PACK_ROWS
        if self.packed or n % PACK_ROWS:
            return self
        if self.bits == 8:  # stored as w + 128 (unsigned): w ^ 0x80
            q = self.qweight.view(b, PACK_ROWS, k // 4, 4).transpose(1, 2) ^ -128
        else:
            q = self.qweight.view(b, PACK_ROWS, k // INT4_GROUP, 4, 4).permute(0, 2, 3, 1, 4)

        def side(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, PACK_ROWS, -1).transpose(1, 2).contiguous()

        mins = None if self.mins is None else side(self.mins)
        q = q.reshape(b, -1, 4 * PACK_ROWS).contiguous()
        return replace(self, qweight=q, scales=side(self.scales), mins=mins)

    def unpack(self) -> QuantizedWeight:
        """This weight in rows (the inverse of `pack`)."""
        if not self.packed:
            return self
        n, k = self.shape
        b = n // PACK_ROWS
        if self.bits == 8:
            q = (self.qweight ^ -128).view(b, k // 4, PACK_ROWS, 4).transpose(1, 2)
        else:
            q = self.qweight.view(b, k // INT4_GROUP, 4, PACK_ROWS, 4).permute(0, 3, 1, 2, 4)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(n, -1).contiguous()

        mins = None if self.mins is None else rows(self.mins)
        return replace(
            self, qweight=q.reshape(n, -1).contiguous(), scales=rows(self.scales), mins=mins
        )

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Outputs (dim 0) or inputs (dim 1, whole groups only) `start` to `start + length`
        (a tensor-parallel shard), as copies."""
        if self.packed:
            return self.unpack().narrow(dim, start, length)
        mins = self.mins
        if dim == 0:
            rows = slice(start, start + length)
            q, scales = self.qweight[rows], self.scales[rows]
            mins = None if mins is None else mins[rows]
        else:
            group = self.group_size
            if start % group or length % group:
                raise ValueError(
                    f"inputs {start}..{start + length} do not split this weight's groups of {group}"
                )
            per = 8 // self.bits
            q = self.qweight[:, start // per : (start + length) // per]
            groups = slice(start // group, (start + length) // group)
            scales = self.scales[:, groups]
            mins = None if mins is None else mins[:, groups]
        mins = None if mins is None else mins.contiguous()
        return replace(self, qweight=q.contiguous(), scales=scales.contiguous(), mins=mins)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, decoded (an embedding lookup)."""
        if self.packed:  # the blocks holding them, unpacked
            blocks = ids.div(PACK_ROWS, rounding_mode="floor")
            mins = None if self.mins is None else self.mins[blocks]
            part = replace(
                self, qweight=self.qweight[blocks], scales=self.scales[blocks], mins=mins
            )
            at = torch.arange(len(ids), device=ids.device) * PACK_ROWS + ids % PACK_ROWS
            return part.unpack().rows(at, dtype)
        mins = None if self.mins is None else self.mins[ids]
        return _decode(self.qweight[ids], self.scales[ids], mins, self.bits).to(dtype)


Weight = torch.Tensor | QuantizedWeight


def _decode(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
) -> torch.Tensor:
    n, groups = scales.shape
    if bits == 8:
        return (q.view(n, groups, -1).float() * scales.float()[..., None]).view(n, -1)
    assert mins is not None
    packed = q.view(n, groups, INT4_GROUP // 2)
    values = torch.cat((packed & 0xF, packed >> 4), dim=-1).float()
    return (values * scales.float()[..., None] + mins.float()[..., None]).view(n, -1)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 with one fp32 scale per `group_size` inputs (default: per output
    channel): scale = max |w| / 127, q = round(w / scale)."""
    n, k = w.shape
    group = group_size or k
    if k % group:
        raise ValueError(f"int8 groups of {group} do not divide the {k} inputs")
    grouped = w.detach().float().reshape(n, k // group, group)
    scales = grouped.abs().amax(dim=-1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grouped / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(8, q.reshape(n, k).contiguous(), scales.contiguous())


def quantize_int4(w: torch.Tensor) -> QuantizedWeight:
    """Affine 4-bit in groups of 32 (as GGUF's Q4_1): min and scale = (max - min) / 15 per
    group, stored in fp16; q = round((w - min) / scale) from the stored fp16 values."""
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs the inputs ({k}) in groups of {INT4_GROUP}")
    grouped = w.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((hi - lo) / 15).half()
    mins = lo.half()
    inv = torch.where(scales > 0, 1 / scales.float(), torch.zeros_like(lo))
    q = torch.round((grouped - mins.float()[..., None]) * inv[..., None]).clamp_(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., : INT4_GROUP // 2] | (q[..., INT4_GROUP // 2 :] << 4)
    return QuantizedWeight(4, packed.reshape(n, k // 2).contiguous(), scales, mins)


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w)
    raise ValueError(f"unknown quantization {method!r}; use one of int8, int4")


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T + bias` for a dense or quantized (N, K) weight; x is (M, K)."""
    module = cpu_kernels.kernel_module()
    few_rows = x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= kernel_rows(w)
    if isinstance(w, torch.Tensor):
        if few_rows and module is not None:
            out = module.linear_dense(x, w, bias)  # on both cores (oneDNN's GEMV runs on one)
            if out is not None:
                return out
        return _matmul(x, w, bias)
    if few_rows and module is not None:
        if w.bits == 8:
            out = module.linear_int8(x, w.qweight, w.scales, bias)
        else:
            out = module.linear_int4(x, w.qweight, w.scales, w.mins, bias)
        if out is not None:
            return out
    dtype = torch.float32 if _in_fp32(x) else x.dtype
    return _matmul(round_activations(x), _dense(w, dtype, module), bias)


def _in_fp32(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype != torch.float32 and not FAST_16BIT_MATMUL


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear; on a CPU without a native 16-bit matmul, 16-bit x times the weight in fp32
    (the weight converted per call: at the rows that come here, a prefill's, the conversion
    is a few percent of the matmul), y rounded back to x's dtype."""
    if not _in_fp32(x):
        return F.linear(x, w, bias)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.float(), b).to(x.dtype)


def packs_on_cpu() -> bool:
    """Whether the CPU kernels take packed weights (`QuantizedWeight.pack`): built with
    AVX-512 VNNI. Elsewhere quantized weights stay in rows."""
    module = cpu_kernels.kernel_module()
    return module is not None and module.packed_rows() == PACK_ROWS


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the quantized kernels round it: to int8 in groups of 32 of its last dim,
    q = round(x * 127 / max |x|) (ties to even) times max |x| / 127, in fp32; back in x's
    dtype. What every quantized linear multiplies, on every path (as llama.cpp does)."""
    *lead, k = x.shape
    if k % ACTIVATION_GROUP:
        return x
    g = x.float().reshape(*lead, k // ACTIVATION_GROUP, ACTIVATION_GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127)).reshape(x.shape).to(x.dtype)


def kernel_rows(w: Weight) -> float:
    """Up to how many rows of x a CPU linear over `w` runs the C++ kernels."""
    if isinstance(w, QuantizedWeight):
        limit = KERNEL_MAX_ROWS["packed" if w.packed else "quantized"]
    else:
        limit = KERNEL_MAX_ROWS["fp32" if w.dtype == torch.float32 else "16-bit"]
    return float("inf") if limit is None else limit


def _dense(w: QuantizedWeight, dtype: torch.dtype, module: Any | None) -> torch.Tensor:
    """The weight decoded for a dense matmul: by the C++ kernels on the CPU, else by torch."""
    out = None
    if module is not None and w.device.type == "cpu":
        if w.bits == 8:
            out = module.dequantize_int8(w.qweight, w.scales)
        else:
            out = module.dequantize_int4(w.qweight, w.scales, w.mins)
    return w.dequantize(dtype) if out is None else out.to(dtype)


def embedding(ids: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding table, dense or quantized, in `dtype`."""
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    return w.rows(ids, dtype)
