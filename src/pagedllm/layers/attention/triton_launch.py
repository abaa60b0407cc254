"""How the Triton attention kernels are launched (host side, no `triton` import): the
tunables, the launch table (tiles, warps, pipeline stages by dtype and head dim), the decode
split-K heuristic and the prefill tiling. See docs/gpu.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

LOG2E = 1.4426950408889634
# a cache of these holds each key and value divided by its layer's scale and cast to fp8
# (kv_cache_dtype.py; AttnLayer.k_scale / v_scale)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class KernelConfig:
    """Tunables. The tile sizes left None come from `decode_launch` / `prefill_launch` (by
    dtype and head dim); set, they apply to every launch (powers of two, >= 16 for `tl.dot`
    on a GPU)."""

    decode_block_n: int | None = None  # keys per decode iteration
    prefill_block_m: int = 64  # query rows per prefill tile (the host's tiling)
    prefill_block_n: int | None = None  # keys per prefill iteration
    max_splits: int = 16  # split-K upper bound for decode
    min_split_tokens: int = 256  # no split shorter than this
    num_sms: int = 132  # an H100 SXM; the backend reads the real count on a GPU
    num_warps: int | None = None

    def __post_init__(self) -> None:
        for name in ("decode_block_n", "prefill_block_m", "prefill_block_n", "max_splits"):
            value = getattr(self, name)
            if value is None:
                continue
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
            if name != "max_splits" and value < 16:
                raise ValueError(f"{name} must be >= 16 (tl.dot on a GPU), got {value}")


@dataclass(frozen=True)
class Launch:
    """One kernel's tile sizes and launch options."""

    block_m: int  # query rows per prefill program (decode: 0, its rows are the query heads)
    block_n: int  # keys per iteration
    num_warps: int
    num_stages: int


def decode_launch(cfg: KernelConfig, dtype: torch.dtype, head_dim: int, group: int) -> Launch:
    """Chosen from the kernel compiled for sm_80 / 89 / 90 / 100 (scripts/kernel_report.py;
    docs/gpu.md), every variant (window, soft-cap, sinks, split): no register spills on any of
    them, shared memory within sm_89's 99 KiB. In 16 bits, 4 warps and 128-key tiles up to head dim
    64 (64-key to 128) were the fastest on an H200 (benchmarks/gpu_decode_sweep.py: 25 %
    under 8 warps and 64-key tiles); head dim 256 (Gemma) halves the key tile again, so that
    the keys and values of a stage stay at 32 KiB. `group` query heads per KV head."""
    width = pow2(head_dim)
    if dtype == torch.float32:  # (16 x 64) fp32 tiles spill at 4 warps
        if width <= 128:
            launch = Launch(0, 32, num_warps=8, num_stages=2)
        else:  # (2 stages spill 8 B on sm_100 when split)
            launch = Launch(0, 16, num_warps=8, num_stages=3)
    elif width <= 64:
        launch = Launch(0, 128, num_warps=4, num_stages=2)
    elif width <= 128:  # (at 4 warps the unsplit MHA tile spills 4 B on sm_90)
        launch = Launch(0, 64, num_warps=4 if group > 1 else 8, num_stages=2)
    else:
        launch = Launch(0, 32, num_warps=4, num_stages=2)
    return _override(launch, cfg, cfg.decode_block_n)


def prefill_launch(cfg: KernelConfig, dtype: torch.dtype, head_dim: int) -> Launch:
    """As `decode_launch`. At head dim > 64 (80 / 96 / 128 are padded to 128) the 64-key tile
    spills, and in fp32 so does the 64-row tile (a host tile of 64 rows then runs as two
    programs of 32); at head dim 256 in fp32 32 x 32 tiles spill KiBs on sm_89 / 90 / 100
    (32 x 16 do not)."""
    width = pow2(head_dim)
    if dtype == torch.float32:
        if width <= 64:
            launch = Launch(64, 32, num_warps=8, num_stages=2)
        elif width <= 128:  # (2 stages spill with a window on sm_80)
            launch = Launch(32, 32, num_warps=8, num_stages=3)
        else:  # (2 stages spill 20 B with a window on sm_80)
            launch = Launch(32, 16, num_warps=8, num_stages=3)
    elif width > 64:
        launch = Launch(64, 32, num_warps=8, num_stages=2)
    else:
        launch = Launch(64, 64, num_warps=4, num_stages=2)
    block_m = min(launch.block_m, cfg.prefill_block_m)
    return _override(dataclasses.replace(launch, block_m=block_m), cfg, cfg.prefill_block_n)


def mla_launch(cfg: KernelConfig, dtype: torch.dtype, rank: int) -> Launch:
    """Latent attention's absorbed decode (triton_mla.py): `block_m` query heads per program
    (16, `tl.dot`'s least rows), `block_n` cached rows of rank + rope per iteration. A
    512-wide latent (DeepSeek-V2/V3) keeps a (16 x 512) fp32 accumulator: 8 warps, and row tiles
    that keep a stage's latent rows at 32 KiB; chosen from the compiled kernel (docs/gpu.md):
    no spills on sm_80/89/90/100."""
    if pow2(rank) <= 128:
        launch = Launch(16, 64 if dtype != torch.float32 else 32, num_warps=4, num_stages=2)
    elif dtype == torch.float32:
        launch = Launch(16, 16, num_warps=8, num_stages=2)
    else:
        launch = Launch(16, 32, num_warps=8, num_stages=2)
    return _override(launch, cfg, cfg.decode_block_n)


def _override(launch: Launch, cfg: KernelConfig, block_n: int | None) -> Launch:
    return dataclasses.replace(
        launch,
        block_n=block_n or launch.block_n,
        num_warps=cfg.num_warps or launch.num_warps,
    )


def pow2(n: int, floor: int = 16) -> int:
    """The smallest power of two >= n, at least `floor` (`tl.dot` tiles are >= 16)."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def num_decode_splits(
    num_decodes: int, num_kv_heads: int, max_context: int, cfg: KernelConfig
) -> int:
    """Split the context only when the (request, kv head) programs cannot fill the GPU, and
    never into pieces shorter than `min_split_tokens`."""
    programs = max(1, num_decodes * num_kv_heads)
    want = -(-2 * cfg.num_sms // programs)  # two waves
    by_length = -(-max_context // cfg.min_split_tokens)
    splits = max(1, min(want, by_length, cfg.max_splits))
    return pow2(splits, 1)


def prefill_tiles(
    query_start_loc: list[int], first_request: int, block_m: int
) -> tuple[list[int], list[int]]:
    """(request of each tile, first row of each tile) for requests `first_request...`:
    computed on the host from the step's lists, so the launch needs no device read."""
    requests, rows = [], []
    for r in range(first_request, len(query_start_loc) - 1):
        q_len = query_start_loc[r + 1] - query_start_loc[r]
        for row in range(0, q_len, block_m):
            requests.append(r)
            rows.append(row)
    return requests, rows


def fp8_scales(
    cache: torch.Tensor, scale: float, softcap: float | None, kv_scales: tuple[float, float]
) -> tuple[float, float, float]:
    """(qk_scale, softcap_log2, v_scale) of an attention kernel: an fp8 cache's k_scale
    folded into the scores' scale (q.(k8 * k_scale) = (q.k8) * k_scale), its v_scale applied to
    the output (linear in the values); 1.0 for the other caches."""
    k_scale, v_scale = kv_scales if cache.dtype in FP8_DTYPES else (1.0, 1.0)
    return (*score_scales(scale * k_scale, softcap), v_scale)


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, softcap_log2): the kernels' scores, in log2 units (they use exp2), are
    `x = q.k * qk_scale` without a soft-cap; with one (`SOFTCAP`) they are
    `softcap_log2 * (2 / (1 + exp2(-x)) - 1)`, i.e. cap * tanh(q.k * scale / cap) * log2(e)
    as tanh(y) = 2 / (1 + exp(-2y)) - 1 (one exp2 per score, no overflow: exp2 -> inf
    gives -cap)."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return 2.0 * scale * LOG2E / softcap, softcap * LOG2E
