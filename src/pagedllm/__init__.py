"""pagedllm: LLM text generation with a paged KV cache and continuous batching, served by
NVIDIA Triton Inference Server."""

from pagedllm.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
