"""Speculative decoding's configuration, as vLLM spells it (`speculative_config`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from pagedllm.errors import ConfigError

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` "ngram" (prompt lookup): the `num_speculative_tokens` tokens that followed the
    latest earlier occurrence of the sequence's last n tokens, n from `prompt_lookup_max` down
    to `prompt_lookup_min`, are proposed and verified in one forward pass
    (`pagedllm.core.spec_decode`). "draft_model" (implied by `model`, a checkpoint directory
    with the target's vocabulary): that model proposes them, one cheap decode step each
    (`pagedllm.worker.draft_runner`), its weights in `quantization` (None: the checkpoint's).
    `max_batch_size`: no proposals while more requests than this are running (the step is
    compute-bound there: verification costs what it saves); `min_acceptance`: a request whose
    recent drafts were accepted less than this share stops proposing for a while (adaptive
    back-off)."""

    method: str = ""  # "" resolves to "draft_model" with a `model`, else "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_batch_size: int = 2  # measured crossover: pays at batch 1, not at 4 (speculative.md)
    min_acceptance: float = 0.2
    model: str | None = None  # the draft model's directory
    quantization: str | None = None  # the draft's weights (config.QUANTIZATIONS)

    def __post_init__(self) -> None:
        if not self.method:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported; use {', '.join(METHODS)}"
            )
        if self.num_speculative_tokens < 1:
            raise ConfigError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if (self.method == "draft_model") != bool(self.model):
            raise ConfigError(
                "a draft model's directory (`model`) goes with method draft_model, and only there"
            )
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.min_acceptance <= 1:
            raise ConfigError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")

    @staticmethod
    def from_dict(
        value: dict[str, Any] | str | SpeculativeConfig | None,
    ) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text); None or {} for no speculation. A lone
        `prompt_lookup_max` (or `_min`) keeps the other's default, clamped to it; unknown keys
        are refused."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ConfigError("speculative_config must be a JSON object")
        if not value:
            return None
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys: {', '.join(unknown)}")
        args = dict(value)
        lo, hi = args.get("prompt_lookup_min"), args.get("prompt_lookup_max")
        if lo is None and hi is not None:
            args["prompt_lookup_min"] = min(int(hi), SpeculativeConfig.prompt_lookup_min)
        if hi is None and lo is not None:
            args["prompt_lookup_max"] = max(int(lo), SpeculativeConfig.prompt_lookup_max)
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if key in args:
                args[key] = int(args[key])
        return SpeculativeConfig(**args)
