"""pagedllm: LLM text generation with a paged KV cache and continuous batching, served by
NVIDIA Triton Inference Server."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.beam_search import BeamSearchParams
    from pagedllm.llm import LLM
    from pagedllm.lora import LoRARequest
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput
    from pagedllm.pooling.params import PoolerConfig, PoolingParams
    from pagedllm.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolerConfig",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"

# NOTE: imported on first use, not here: the Triton models that only tokenize, detokenize or
# translate a client's contract import pagedllm's serving modules, and torch (2-3 s of CPU and
# a few hundred MB in each of their stub processes) is for the engine's alone.
_HOMES = {
    "LLM": "pagedllm.llm",
    "BeamSearchParams": "pagedllm.beam_search",
    "CompletionOutput": "pagedllm.outputs",
    "LoRARequest": "pagedllm.lora",
    "RequestOutput": "pagedllm.outputs",
    "EmbeddingOutput": "pagedllm.pooling.outputs",
    "EmbeddingRequestOutput": "pagedllm.pooling.outputs",
    "PoolerConfig": "pagedllm.pooling.params",
    "PoolingParams": "pagedllm.pooling.params",
    "SamplingParams": "pagedllm.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
