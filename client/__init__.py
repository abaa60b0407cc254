"""Clients of a running pagedllm Triton server: `python -m client.stream` (one streamed
generation) and `python -m client.benchmark` (served vs offline throughput)."""
