"""Our own Llama-family modules and the HF checkpoint loader (no `transformers` at run time)."""

from pagedllm.model.decoder import CausalLM
from pagedllm.model.loader import load_model

__all__ = ["CausalLM", "load_model"]
