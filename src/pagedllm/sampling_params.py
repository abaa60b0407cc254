"""Per-request generation settings, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to generate for one request.

    Only greedy decoding is implemented by the engine core so far: `temperature` must be 0.
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.temperature != 0:
            raise NotImplementedError("only greedy decoding (temperature=0) is supported yet")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
