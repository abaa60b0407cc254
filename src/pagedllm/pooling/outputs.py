"""What `LLM.embed` returns, shaped as vLLM's `EmbeddingRequestOutput` / `EmbeddingOutput`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # no prefix cache in the pooling engine (docs/embeddings.md)
