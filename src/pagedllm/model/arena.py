"""A CPU model's weights moved into one anonymous mapping on transparent huge pages, and its
KV caches allocated in another (`zeros`).

Decode reads every weight once per step, front to back: on 4 KiB pages that is a TLB miss
every 4 KiB (a 135M-parameter fp32 model: 130k per step). Linux hands out 2 MiB pages to a
mapping that asks for them (`madvise(MADV_HUGEPAGE)`, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`, the usual default),
which torch's allocator never does. On a 2-core Xeon this streams the weights about 8 %
faster (`benchmarks/peers.py`'s batch-1 decode). Where the platform has no such call the
weights stay where they are.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import replace

import torch

from pagedllm.layers.quant import QuantizedWeight

_HUGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _size(t: torch.Tensor) -> int:
    return _aligned(t.numel() * t.element_size())


class Arena:
    """One mapping of `size` bytes (rounded up to huge pages), handed out front to back."""

    def __init__(self, size: int) -> None:
        size = (size + _HUGE - 1) // _HUGE * _HUGE + _HUGE  # + room to align the start
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._at = (-self._bytes.data_ptr()) % _HUGE

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next `shape` x `dtype` of the arena, contiguous (zeros where nothing was
        written: the mapping starts zeroed)."""
        n = math.prod(shape) * dtype.itemsize
        out = self._bytes[self._at : self._at + n].view(dtype).view(shape)
        self._at += _aligned(n)
        return out

    def touch(self) -> None:
        """Map every page now (a byte a page, written with the zero it holds)."""
        self._bytes[:: mmap.PAGESIZE] = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` copied into the arena (same dtype and shape, contiguous)."""
        out = self.take(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out


def zeros(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    """`count` zero CPU tensors of `shape` back to back in one huge-page mapping: the KV
    caches, which decode attention reads block by block from wherever the blocks lie (on 4 KiB
    pages a TLB miss every few keys). Every page is touched now, as torch.zeros would, so a
    machine short of memory fails here, not mid-run. torch.zeros off Linux."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    arena = Arena(_aligned(math.prod(shape) * dtype.itemsize) * count)
    tensors = [arena.take(shape, dtype) for _ in range(count)]
    arena.touch()
    return tensors


def adopt(model: torch.nn.Module) -> int:
    """Move `model`'s CPU parameters (shared ones once) and its quantized weights (a
    `quantized` dict of QuantizedWeight, if it has one) into a huge-page arena; the bytes
    moved (0 off Linux). Each tensor holds the mapping, which goes when the last one does."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    params = {id(p): p for p in model.parameters() if p.device.type == "cpu" and p.numel()}
    quantized: dict[str, QuantizedWeight] = getattr(model, "quantized", {})
    parts = [t for q in quantized.values() for t in (q.qweight, q.scales, q.mins) if t is not None]
    total = sum(_size(p.data) for p in params.values()) + sum(_size(t) for t in parts)
    if total == 0:
        return 0
    arena = Arena(total)
    with torch.no_grad():
        for p in params.values():
            p.data = arena.copy(p.data.contiguous())
    for name, q in quantized.items():
        mins = None if q.mins is None else arena.copy(q.mins)
        qweight, scales = arena.copy(q.qweight), arena.copy(q.scales)
        quantized[name] = replace(q, qweight=qweight, scales=scales, mins=mins)
    return total
