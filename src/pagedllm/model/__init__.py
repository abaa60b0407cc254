"""Our own Llama-family modules and the HF checkpoint loader (no `transformers` at run time)."""

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_model

__all__ = ["LlamaForCausalLM", "load_model"]
