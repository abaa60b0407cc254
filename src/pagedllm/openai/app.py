"""The ASGI application of `pagedllm openai` (Starlette, served by uvicorn): the routes.

An OpenAI request becomes one Triton request per sample (`n` per prompt; seeds `seed + i`);
their responses are merged as they come (`streaming`). A streamed request waits for every
sample's first response before it answers, so a request Triton refuses still gets a plain HTTP
error (400 with our message, 429 when the engine is busy); later failures end the stream with
an `error` event. A client that goes away cancels every Triton request it started (streamed or
not). Bodies are read by `request_body` (media type, size and nesting checked first), validated
by `protocol`, answered by the builders of `responses`; errors are shaped by `errors`. A prompt
is sent as text, or as token ids when the gateway needs them (a token-id prompt, vLLM's
`return_token_ids`, `truncate_prompt_tokens`: the gateway's tokenizer is the server's).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedllm.convert import to_bool
from pagedllm.lora.request import runtime_updating_allowed
from pagedllm.openai.beams import beam_choices, beam_requests
from pagedllm.openai.chat import ChatTemplate
from pagedllm.openai.chat_fields import ChatTemplateFields, render_chat
from pagedllm.openai.embeddings import Embeddings
from pagedllm.openai.errors import APIError, bad_request, from_triton, internal_error
from pagedllm.openai.lora_admin import LoRAModels, not_found
from pagedllm.openai.lora_resolver import cache_dir_from_env
from pagedllm.openai.metrics import MetricsRelay, default_metrics_url
from pagedllm.openai.models import ServedModel
from pagedllm.openai.protocol import ChatCompletionRequest, CompletionRequest, Prompt, parse_body
from pagedllm.openai.request_body import MAX_BODY_BYTES, read_json
from pagedllm.openai.responses import Builder, ChatBuilder, CompletionBuilder
from pagedllm.openai.samples import Sample, make_samples
from pagedllm.openai.streaming import (
    ClientGone,
    EventStream,
    collect,
    first_chunks,
    merged,
    sse_body,
    until_disconnect,
)
from pagedllm.openai.structured import Constraint
from pagedllm.openai.tokenize import Tokenization
from pagedllm.openai.tokens import TokenTexts
from pagedllm.openai.tools import ToolUse, template_inputs
from pagedllm.openai.triton import TritonBridge, TritonError
from pagedllm.text.tokenizer import Tokenizer

T = TypeVar("T", CompletionRequest, ChatCompletionRequest)
# what turns on `trust_request_chat_template` for `pagedllm openai`
TRUST_TEMPLATE_ENV = "PAGEDLLM_TRUST_REQUEST_CHAT_TEMPLATE"


def _trust_env() -> bool:
    return to_bool(TRUST_TEMPLATE_ENV, os.environ.get(TRUST_TEMPLATE_ENV) or "false")


@dataclass(frozen=True)
class GatewayConfig:
    triton_url: str
    model_dir: str
    served_model_name: str | None = None
    chat_template: str | None = None  # a file overriding the model's template
    triton_model: str = "ensemble"
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies answer 413
    metrics_url: str | None = None  # Triton's, relayed at /metrics; None: triton_url's host:8002
    # a request may bring its own chat template (vLLM's --trust-request-chat-template)
    trust_request_chat_template: bool = field(default_factory=_trust_env)
    # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = field(default_factory=runtime_updating_allowed)
    # vLLM's lora_filesystem_resolver (VLLM_PLUGIN_LORA_CACHE_DIR): unknown names loaded from it
    lora_cache_dir: str | None = field(default_factory=cache_dir_from_env)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name


class Gateway:
    """The state behind the routes: Triton bridge, tokenizer (log-prob token strings and bytes,
    token-id prompts), chat template, served model name."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        self.tokens = TokenTexts(self.tokenizer, config.model_dir)
        self.chat_template = ChatTemplate.from_model_dir(
            config.model_dir, self.tokenizer, config.chat_template
        )
        # the model's special tokens, for a request's own template
        self.template_tokens = ChatTemplate.special_tokens_of(config.model_dir, self.tokenizer)
        self.bridge = TritonBridge(config.triton_url, config.triton_model)
        self.model = ServedModel(self.model_name, config.model_dir, self.bridge)
        allow = config.allow_runtime_lora_updating  # the base model and the engine's adapters
        self.loras = LoRAModels(
            self.bridge.client, self.model, allow, config.max_body_bytes, config.lora_cache_dir
        )
        # vLLM's /tokenize and /detokenize: models checked, templates chosen as here
        self.tokenization = Tokenization(
            self.tokens, self.model, config.max_body_bytes, self.loras.resolve, self._template
        )
        self.embeddings = Embeddings(  # /v1/embeddings: a server with the pooling runner
            self.bridge.client, self.model_name, self._check_model, config.max_body_bytes
        )

    # --- routes ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not await self.bridge.is_ready():
            raise APIError(503, f"Triton at {self.config.triton_url} is not ready")
        return JSONResponse({"status": "ok"})

    async def server_info(self, request: Request) -> Response:
        # what a router of the SGLang family (smg) reads when it adds this gateway as a worker:
        # the model name it then lists and routes by (docs/routing.md)
        return JSONResponse({"served_model_name": self.model_name})

    async def completions(self, request: Request) -> Response:
        body = await self._body(request, CompletionRequest)
        lora = await self.loras.resolve(body.model)  # {} or the adapter's lora_name
        given = body.prompts(self.tokens.vocab_size)
        keep = await self._keep(body)
        prompts = [await self._prompt(body, p, keep) for p in given]
        # with echo, log-probs cover the prompt too: vLLM asks for as many alternatives there
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo:
            prompt_logprobs = body.logprobs
        echo = None
        if body.echo:  # the prompt's text, or the text of the ids the model saw
            echo = [self._echo(g, p, keep) for g, p in zip(given, prompts, strict=True)]
        if body.use_beam_search:
            if lora:
                raise bad_request("beam search with a LoRA adapter is not supported", "model")
            return await self._beam_search(request, body, prompts, echo)
        extra = {**self._extra(body, body.constraint), **lora}
        samples = make_samples(
            body, prompts, body.max_tokens, body.logprobs, prompt_logprobs, extra
        )
        builder = CompletionBuilder(body.model, self.tokens, body, samples, echo)
        return await self._answer(request, body, samples, builder, "prompt", body.constraint)

    async def _beam_search(
        self, request: Request, body: CompletionRequest, prompts: list[Prompt], echo: Any
    ) -> Response:
        """vLLM's `use_beam_search` (`openai.beams`): the choices are each prompt's beams."""
        requests = beam_requests(body, prompts, body.max_tokens)
        stream = merged(self.bridge, requests)
        try:
            choices = await until_disconnect(request, beam_choices(stream, requests))
        except TritonError as e:
            raise from_triton(e, "prompt", None) from None
        finally:
            await stream.aclose()
        builder = CompletionBuilder(self.model_name, self.tokens, body, choices, echo)
        return JSONResponse(builder.final())

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request, ChatCompletionRequest)
        lora = await self.loras.resolve(body.model)
        template = self._template(body)
        tools = ToolUse.of(body.tools, body.tool_choice, body.parallel_tool_calls)
        given = body.template_messages()
        messages, definitions = template_inputs(given, tools, template.accepts_tools)
        text = render_chat(template, messages, definitions, body)
        prompt = await self._prompt(body, text, await self._keep(body))
        constraint, reads_calls = body.constraint, False
        extra = {}
        if tools is not None:
            specials = self.tokens.special_tokens
            constraint, reads_calls = tools.resolve(constraint, specials)
            if reads_calls and tools.keeps_special_tokens(specials):
                extra["skip_special_tokens"] = False
        extra.update(self._extra(body, constraint), **lora)
        top = (body.top_logprobs or 0) if body.logprobs else None
        samples = make_samples(body, [prompt], body.output_limit, top, body.prompt_logprobs, extra)
        builder = ChatBuilder(
            body.model,
            self.tokens,
            body,
            samples,
            tools if reads_calls else None,
            role=body.answer_role(given),
            echo=body.echoed(given),
        )
        return await self._answer(request, body, samples, builder, "messages", constraint)

    # --- helpers --------------------------------------------------------------------------

    async def _body(self, request: Request, model: type[T]) -> T:
        return parse_body(model, await read_json(request, self.config.max_body_bytes))

    def _template(self, body: ChatTemplateFields) -> ChatTemplate:
        """The request's own template (when the gateway trusts them), else the model's."""
        if body.chat_template is None:
            if self.chat_template is None:
                raise bad_request(
                    f"the model {self.model_name} has no chat template (start the gateway "
                    "with --chat-template FILE)",
                    "messages",
                )
            return self.chat_template
        if not self.config.trust_request_chat_template:
            raise bad_request(
                "chat_template: a request's own chat template is refused: this gateway does not "
                f"trust them (vLLM's --trust-request-chat-template; {TRUST_TEMPLATE_ENV}=1)",
                "chat_template",
            )
        try:
            return self.template_tokens.with_source(body.chat_template)
        except jinja2.TemplateError as e:
            message = f"chat_template is not a valid template: {e}"
            raise bad_request(message, "chat_template") from None

    async def _keep(self, body: Any) -> int | None:
        """How many of a prompt's last tokens to keep (`truncate_prompt_tokens`; None: all)."""
        if body.truncate_prompt_tokens is None:
            return None
        return body.truncation(await self.model.max_model_len())

    async def _prompt(self, body: Any, prompt: Prompt, keep: int | None) -> Prompt:
        """The prompt to send: as given, or as token ids when they are needed (vLLM's
        `return_token_ids`) or truncated to the last `keep` (`truncate_prompt_tokens`)."""
        if keep is None and not body.return_token_ids:
            return prompt
        if isinstance(prompt, str):  # as the server's tokenizer model encodes it
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            ids = prompt
        return ids[-keep:] if keep is not None else ids

    def _echo(self, given: Prompt, sent: Prompt, keep: int | None) -> str:
        """A completions prompt's echo: its text as given (a text prompt not truncated), else
        the text of the ids sent."""
        if isinstance(given, str) and (isinstance(sent, str) or keep is None):
            return given
        return self.tokens.decode(sent) if isinstance(sent, list) else sent

    def _extra(self, body: Any, constraint: Constraint | None) -> dict[str, Any]:
        """Sampling parameters beyond the shared ones: the constraint, logit_bias and
        allowed_token_ids."""
        return {**_structured(constraint), **body.token_parameters(self.tokens.logits_size)}

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise not_found(model)

    async def _answer(
        self,
        request: Request,
        body: Any,
        samples: list[Sample],
        builder: Builder,
        prompt_param: str,
        constraint: Constraint | None = None,
    ) -> Response:
        stream = merged(self.bridge, samples)
        try:
            if not body.stream:
                await until_disconnect(request, collect(stream, samples))
                return JSONResponse(builder.final())
            first = await until_disconnect(request, first_chunks(stream, len(samples)))
        except TritonError as e:
            await stream.aclose()
            raise from_triton(e, prompt_param, constraint.param if constraint else None) from None
        except BaseException:
            await stream.aclose()
            raise
        return EventStream(sse_body(builder, samples, first, stream, prompt_param))


def _structured(constraint: Constraint | None) -> dict[str, Any]:
    return {} if constraint is None else {"structured_outputs": constraint.spec}


# --- the application -----------------------------------------------------------------------


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = APIError(exc.status_code, str(exc.detail)).response()
    response.headers.update(exc.headers or {})  # e.g. a 405's Allow
    return response


async def _client_gone_response(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it


async def _server_error_response(request: Request, exc: Exception) -> Response:
    return internal_error(f"{request.method} {request.url.path}", exc).response()


def create_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)
    metrics = MetricsRelay(config.metrics_url or default_metrics_url(config.triton_url))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await gateway.bridge.close()

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        APIError: _api_error_response,
        HTTPException: _http_error_response,
        ClientGone: _client_gone_response,
        ClientDisconnect: _client_gone_response,
        Exception: _server_error_response,
    }
    app = Starlette(
        routes=[
            Route("/health", gateway.health, methods=["GET"]),
            Route("/v1/models", gateway.loras.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", gateway.loras.get_model, methods=["GET"]),
            Route("/server_info", gateway.server_info, methods=["GET"]),
            Route("/v1/completions", gateway.completions, methods=["POST"]),
            Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
            Route("/v1/embeddings", gateway.embeddings.create, methods=["POST"]),
            Route("/metrics", metrics.metrics, methods=["GET"]),
            Route("/tokenize", gateway.tokenization.tokenize, methods=["POST"]),  # vLLM's
            Route("/detokenize", gateway.tokenization.detokenize, methods=["POST"]),
            *gateway.loras.routes(),  # vLLM's runtime LoRA routes, where allowed
        ],
        exception_handlers=handlers,
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app


def serve(config: GatewayConfig, host: str, port: int) -> int:
    """`pagedllm openai`: run the gateway until Ctrl-C."""
    import uvicorn

    app = create_app(config)
    print(
        f"OpenAI-compatible API for {config.model_name} on http://{host}:{port}/v1 "
        f"(Triton gRPC at {config.triton_url})",
        flush=True,
    )
    uvicorn.run(app, host=host, port=port, log_level="info")
    return 0
