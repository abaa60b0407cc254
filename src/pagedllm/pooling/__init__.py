"""Embeddings: a causal LM as an embedder (vLLM's pooling runner); docs/embeddings.md."""
