"""Pooling settings, as vLLM spells them: the engine's `PoolerConfig` (how hidden states become
one vector), a request's `PoolingParams`, and the defaults a checkpoint declares.

Defaults come, in this order, from the `PoolerConfig` fields the caller set, then from a
sentence-transformers checkpoint (`modules.json`: a `Pooling` module whose `config.json` names
the mode, and a `Normalize` module), then LAST + normalise (vLLM's `convert="embed"` of a
`*ForCausalLM`). Matryoshka truncation (`dimensions`) is allowed where the model's
`config.json` says so (`matryoshka_dimensions`, or `is_matryoshka: true`), as vLLM checks it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
DEFAULT_POOLING_TYPE = "LAST"

# sentence-transformers' pooling modes (1_Pooling/config.json) that have a pooling type here
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


def check_pooling_type(value: str) -> str:
    upper = value.upper()
    if upper not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {value!r}")
    return upper


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's `PoolerConfig`: None fields take the checkpoint's defaults (see the module)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    # a default output size for every request (Matryoshka models only)
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", check_pooling_type(self.pooling_type))


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's `PoolingParams` for `embed`: `dimensions` truncates the vector (before it is
    normalised); `normalize` overrides the engine's; `truncate_prompt_tokens` keeps the last
    k tokens of a longer prompt (-1: the engine's max_model_len)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {k}")


@dataclass(frozen=True)
class ResolvedPooler:
    """The engine's pooler once every default is settled."""

    pooling_type: str
    normalize: bool
    dimensions: int | None
    hidden_size: int
    # None: no Matryoshka truncation; () any size up to hidden_size; else the sizes allowed
    matryoshka: tuple[int, ...] | None

    def output_size(self, params: PoolingParams) -> int:
        """The vector size a request gets; ValueError where the model does not allow it."""
        dims = params.dimensions if params.dimensions is not None else self.dimensions
        if dims is None or dims == self.hidden_size:
            return self.hidden_size
        if self.matryoshka is None:
            raise ValueError(
                "this model does not support Matryoshka representations: "
                f"dimensions={dims} would change its output size ({self.hidden_size}); "
                "leave it out"
            )
        if dims > self.hidden_size or (self.matryoshka and dims not in self.matryoshka):
            allowed = list(self.matryoshka) or f"1..{self.hidden_size}"
            raise ValueError(f"dimensions={dims} is not one this model allows ({allowed})")
        return dims


def resolve_pooler(model_dir: str | Path, config: PoolerConfig | None) -> ResolvedPooler:
    """`config`'s settings over the checkpoint's (sentence-transformers files) over LAST +
    normalise."""
    config = config or PoolerConfig()
    path = Path(model_dir)
    hf = _read_json(path / "config.json") or {}
    st_type, st_normalize = sentence_transformers_defaults(path)
    pooling_type = config.pooling_type or st_type or DEFAULT_POOLING_TYPE
    normalize = config.normalize
    if normalize is None:
        normalize = st_normalize if st_type is not None else True
    matryoshka: tuple[int, ...] | None = None
    if hf.get("matryoshka_dimensions"):
        matryoshka = tuple(int(d) for d in hf["matryoshka_dimensions"])
    elif hf.get("is_matryoshka"):
        matryoshka = ()
    hidden = int(hf.get("hidden_size") or hf.get("text_config", {}).get("hidden_size", 0))
    resolved = ResolvedPooler(pooling_type, bool(normalize), None, hidden, matryoshka)
    if config.dimensions is not None:  # checked as a request's would be
        resolved.output_size(PoolingParams(dimensions=config.dimensions))
        resolved = ResolvedPooler(
            pooling_type, bool(normalize), config.dimensions, hidden, matryoshka
        )
    return resolved


def sentence_transformers_defaults(model_dir: Path) -> tuple[str | None, bool]:
    """(pooling type, normalise) a sentence-transformers checkpoint declares; (None, False)
    where it is not one. A pooling mode with no pooling type here is refused."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None, False
    types = {m.get("type"): m for m in modules if isinstance(m, dict)}
    normalize = _ST_NORMALIZE in types
    pooling = types.get(_ST_POOLING)
    if pooling is None:
        return None, normalize
    st = _read_json(model_dir / str(pooling.get("path", "")) / "config.json") or {}
    modes = [mode for mode, on in st.items() if mode.startswith("pooling_mode_") and on]
    if not modes:
        return None, normalize
    if len(modes) > 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"sentence-transformers pooling {modes} is not supported: "
            f"one of {sorted(_ST_MODES)} (or set PoolerConfig.pooling_type)"
        )
    return _ST_MODES[modes[0]], normalize


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        return json.load(f)
