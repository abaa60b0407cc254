"""The KV cache's element type (vLLM's `kv_cache_dtype`): its names, the storage dtype, the
bytes a token takes with its scales, and which devices can run it.

- `auto`: the model's dtype.
- `fp8` (= `fp8_e4m3`), `fp8_e5m2`: one byte per value, cast with scale 1.0 (vLLM's
  `k_scale` / `v_scale` are not read from checkpoints yet); the GPU's (Triton kernels: e4m3
  on sm_89 and newer, e5m2 on sm_80 too) and the CPU's torch reference path (emulated).
- `int8_per_token_head` (= `int8`): one byte per value and one fp32 scale per token, KV head
  and K/V, stored beside its row in the block: a layer's cache is int8
  (num_blocks, block_size, 2, kv_heads, head_dim + 4), the last 4 bytes of each row the
  row's scale (absmax / 127). The CPU's (C++ kernels and torch reference path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from pagedllm.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where it is needed: the CLI's parser imports this
    import torch

# vLLM's values, plus `int8` for its int8_per_token_head
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "int8")
_CANONICAL = {
    "auto": "auto",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "int8_per_token_head": "int8",
    "int8": "int8",
}
FP8 = ("fp8_e4m3", "fp8_e5m2")
SCALE_BYTES = 4  # an int8 row's fp32 scale, after its head_dim values


def check_kv_cache_dtype(value: str | None) -> str:
    """The canonical name of a `kv_cache_dtype`: auto, fp8_e4m3, fp8_e5m2 or int8."""
    name = (value or "auto").strip().lower()
    if name not in _CANONICAL:
        raise ConfigError(
            f"unsupported kv_cache_dtype {value!r}; use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return _CANONICAL[name]


def storage_dtype(kind: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a layer's cache tensor."""
    import torch

    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    return torch.int8 if kind == "int8" else fp8.get(kind, model_dtype)


def row_extra(kind: str) -> int:
    """Elements (bytes) appended to each (token, K/V, head) row of the cache: the int8 scale."""
    return SCALE_BYTES if kind == "int8" else 0


def bytes_per_token_layer(kind: str, model_dtype: torch.dtype, values: int, head_dim: int) -> int:
    """One layer's cache bytes per token, `values` keys and values of `head_dim` each, scales
    included."""
    if kind == "auto":
        return values * model_dtype.itemsize
    return values + values // head_dim * row_extra(kind)


def check_supported(kind: str, device: str, latent: bool) -> None:
    """Refuse, before anything is loaded, a cache dtype this device or model cannot run."""
    if kind == "auto":
        return
    if latent:
        raise ConfigError(f"kv_cache_dtype {kind}: latent attention (MLA) caches need auto")
    if kind == "int8" and device.startswith("cuda"):
        raise ConfigError(
            "kv_cache_dtype int8 (int8_per_token_head) runs on the CPU only; on a GPU use fp8"
        )
    if kind == "fp8_e4m3" and device.startswith("cuda"):
        import torch

        capability = torch.cuda.get_device_capability(torch.device(device))
        check_fp8_e4m3(capability)


def check_fp8_e4m3(capability: tuple[int, int]) -> None:
    """e4m3 (Triton's fp8e4nv) compiles for sm_89 and newer only; e5m2 for sm_80 too
    (tests/test_kernels_compile.py). Not emulated: refused."""
    if capability < (8, 9):
        major, minor = capability
        raise ConfigError(
            f"kv_cache_dtype fp8 (fp8_e4m3) needs a GPU of compute capability 8.9 or newer "
            f"(this one: {major}.{minor}): Triton cannot compile e4m3 there and pagedllm does "
            "not emulate it; use fp8_e5m2 (which it compiles for 8.0) or auto"
        )


def dtype_name(kind: str, model_dtype: torch.dtype) -> str:
    """The cache's element type as reported: the kind, or the model's dtype for auto."""
    return str(model_dtype).removeprefix("torch.") if kind == "auto" else kind


class KVCacheReport(TypedDict):
    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_token_capacity: int
