"""An OpenAI-compatible HTTP gateway in front of a running `tritonserver`: `pagedllm openai`.

`protocol` validates OpenAI requests and builds OpenAI-shaped responses, `chat` renders the
model's chat template, `triton` streams one generation from the `ensemble` model over gRPC
(cancelled when the caller stops listening), `app` is the ASGI application. Nothing here
imports Triton's in-process bindings: any reachable server works (docs/openai.md).
"""
