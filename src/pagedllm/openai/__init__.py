"""An OpenAI-compatible HTTP gateway in front of a running `tritonserver`: `pagedllm openai`.

`request_body` reads a POST body (JSON only; size and nesting bounded before parsing),
`protocol` validates OpenAI requests (token-id prompts too), `structured` resolves their
structured-output fields into one constraint, `tools` turns `tools` / `tool_choice` into a
prompt and a grammar, `tool_parser` reads tool calls from the text as it streams, `errors`
shapes errors (and maps Triton's), `chat` renders the model's chat template, `tokens` gives
log-probs' token strings and raw bytes, `triton` streams one generation from the `ensemble`
model over gRPC (cancelled when the caller stops listening), `streaming` merges the samples of an
answer and sends server-sent events, `responses` builds OpenAI's response objects, `app` is
the ASGI application. Nothing here imports Triton's in-process bindings: any reachable server
works (docs/openai.md).
"""
