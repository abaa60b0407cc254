"""Tensor parallelism's building blocks: how a model splits (`shard`), the collectives
(`comm`), and worker processes tied to their parent (`processes`)."""
