"""vLLM's `/tokenize` and `/detokenize` (at the root, as vLLM serves them: not under `/v1`).

- `POST /tokenize`, completion form `{"model", "prompt", "add_special_tokens": true,
  "return_token_strs": false}`: the prompt's ids as the server's tokenizer encodes it.
- `POST /tokenize`, chat form `{"model", "messages", "add_generation_prompt": true,
  "continue_final_message": false, "add_special_tokens": false, "chat_template",
  "chat_template_kwargs", "documents", "tools", "return_token_strs"}`: the chat rendered as
  chat completions render it (`chat_fields`: the same checks, a request's own template only
  when the gateway trusts them; tools as `tools.template_inputs` gives them), then encoded as
  `transformers`' `apply_chat_template(tokenize=True)` encodes it: the rendered text, BOS
  included, with no special tokens added unless `add_special_tokens`.
- Both answer `{"count", "max_model_len", "tokens", "token_strs"}`; `token_strs` (the
  vocabulary's pieces, `convert_ids_to_tokens`) is null unless asked for.
- `POST /detokenize` `{"model", "tokens"}` answers `{"prompt"}`: the ids' text, special tokens
  kept (`transformers`' `decode`); ids outside the vocabulary are refused, named.

`model` may be left out (vLLM's rule); it may name the served model or one of its LoRA
adapters (which share its tokenizer); any other name answers 404 as on the other routes. As vLLM's, both refuse more tokens than `max_model_len` (what `/v1/models`
reports).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from functools import cached_property
from pathlib import Path
from typing import Any, cast

from pydantic import StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from tokenizers import Tokenizer as _HFTokenizer

from pagedllm.openai.chat import ChatTemplate
from pagedllm.openai.chat_fields import ChatTemplateFields, render_chat
from pagedllm.openai.errors import bad_request
from pagedllm.openai.models import ServedModel
from pagedllm.openai.protocol import ChatMessage, check_utf8, parse_body, template_messages
from pagedllm.openai.request_body import read_json
from pagedllm.openai.structured import Strict
from pagedllm.openai.tokens import TokenTexts
from pagedllm.openai.tools import Tool, ToolUse, template_inputs

MAX_NAMED_IDS = 10  # a refusal names at most this many bad ids


class TokenizeCompletionRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    def check(self) -> None:
        check_utf8(self.prompt, "prompt")


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    messages: list[ChatMessage]
    # the template adds the special tokens (vLLM's default): more only when asked
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[Tool] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's; no effect on a text model

    def check(self) -> None:
        self.check_chat_template_fields()
        if self.echo:
            raise bad_request("echo is a chat completions field: /tokenize has no answer", "echo")
        for name in ("chat_template", "chat_template_kwargs", "documents"):
            check_utf8(getattr(self, name), name)
        check_utf8([t.model_dump() for t in self.tools or []], "tools")
        for i, message in enumerate(self.messages):
            check_utf8(message.model_dump(exclude_none=True), f"messages[{i}]")

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them (as chat completions give them)."""
        return template_messages(self.messages)


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[StrictInt]

    def check(self) -> None:
        pass


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def tokenize_body(raw: Any) -> TokenizeRequest:
    """A `/tokenize` body: the chat form when it has `messages`, else the completion form."""
    if isinstance(raw, dict) and "messages" in raw and "prompt" in raw:
        raise bad_request("give either prompt or messages, not both", "prompt")
    chat = isinstance(raw, dict) and "messages" in raw
    form = TokenizeChatRequest if chat else TokenizeCompletionRequest
    return cast(TokenizeRequest, parse_body(cast(Any, form), raw))


class Tokenization:
    """The two routes. `check_model` answers 404 for a model not served (the base model or an
    adapter); `template_of` is the
    chat template of a chat request (its own, when the gateway trusts them; else the model's),
    with the same 400s as chat completions."""

    def __init__(
        self,
        tokens: TokenTexts,
        model: ServedModel,
        max_body_bytes: int,
        check_model: Callable[[str], Awaitable[object]],
        template_of: Callable[[ChatTemplateFields], ChatTemplate],
    ) -> None:
        self.tokens = tokens
        self.tokenizer = tokens.tokenizer
        self.model = model
        self.max_body_bytes = max_body_bytes
        self.check_model = check_model
        self.template_of = template_of

    @cached_property
    def _pieces(self) -> _HFTokenizer:
        # the vocabulary's own pieces (`convert_ids_to_tokens`), loaded when first asked for
        return _HFTokenizer.from_file(str(Path(self.model.root) / "tokenizer.json"))

    async def tokenize(self, request: Request) -> Response:
        body = tokenize_body(await read_json(request, self.max_body_bytes))
        await self.check_model(body.model or self.model.name)
        if isinstance(body, TokenizeChatRequest):
            text, param = self._render(body, self.template_of(body)), "messages"
        else:
            text, param = body.prompt, "prompt"
        ids = await asyncio.to_thread(self.tokenizer.encode, text, body.add_special_tokens)
        max_model_len = await self._check_length(len(ids), param)
        strs = [self._pieces.id_to_token(t) for t in ids] if body.return_token_strs else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: Request) -> Response:
        raw = await read_json(request, self.max_body_bytes)
        body = cast(DetokenizeRequest, parse_body(cast(Any, DetokenizeRequest), raw))
        await self.check_model(body.model or self.model.name)
        vocab = self.tokens.vocab_size
        bad = [(k, t) for k, t in enumerate(body.tokens) if not 0 <= t < vocab]
        if bad:
            shown = ", ".join(str(t) for _, t in bad[:MAX_NAMED_IDS])
            more = f" and {len(bad) - MAX_NAMED_IDS} more" if len(bad) > MAX_NAMED_IDS else ""
            message = (
                f"tokens: {shown}{more} {'is' if len(bad) == 1 else 'are'} outside the "
                f"vocabulary (token ids are integers from 0 to {vocab - 1})"
            )
            raise bad_request(message, f"tokens[{bad[0][0]}]")
        await self._check_length(len(body.tokens), "tokens")
        text = await asyncio.to_thread(self.tokens.decode, body.tokens)
        return JSONResponse({"prompt": text})

    def _render(self, body: TokenizeChatRequest, template: ChatTemplate) -> str:
        """The chat's text as chat completions render it, but with the template's BOS kept:
        `add_special_tokens` says whether the tokenizer adds its own (transformers' rule)."""
        tools = ToolUse.of(body.tools, None, None)
        given = body.template_messages()
        messages, definitions = template_inputs(given, tools, template.accepts_tools)
        if body.continue_final_message and not messages:
            raise bad_request("continue_final_message needs a final message", "messages")
        whole = copy.copy(template)
        whole.strip_bos = False
        return render_chat(whole, messages, definitions, body)

    async def _check_length(self, count: int, param: str) -> int | None:
        """The model's max_model_len; 400 for more tokens than it (vLLM's check and words)."""
        limit = await self.model.max_model_len()
        if limit is not None and count > limit:
            raise bad_request(
                f"You passed {count} input tokens and requested 0 output tokens. However, the "
                f"model's context length is only {limit} tokens, resulting in a maximum input "
                f"length of {limit} tokens. Please reduce the length of the input prompt.",
                param,
            )
        return limit
