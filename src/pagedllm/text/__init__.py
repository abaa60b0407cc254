from pagedllm.text.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
