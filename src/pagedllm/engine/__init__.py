from pagedllm.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
