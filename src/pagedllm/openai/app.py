"""The ASGI application of `pagedllm openai` (Starlette, served by uvicorn).

An OpenAI request becomes one Triton request per sample (`n` per prompt; seeds `seed + i`);
their responses are merged as they come. A streamed request waits for every sample's first
response before it answers, so a request Triton refuses still gets a plain HTTP error (400 with
our message); later failures end the stream with an `error` event. A client that goes away
cancels every Triton request it started (streamed or not).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pagedllm.openai.chat import ChatTemplate, ChatTemplateError
from pagedllm.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_body,
)
from pagedllm.openai.triton import Chunk, Generation, TritonBridge, TritonError
from pagedllm.text.tokenizer import Tokenizer

T = TypeVar("T")
# requests answering more choices than this (prompts x n) are refused
MAX_CHOICES = 64
# parameter names a Triton error message may name (the first one found is reported)
_PARAMS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt",
)


@dataclass(frozen=True)
class GatewayConfig:
    triton_url: str
    model_dir: str
    served_model_name: str | None = None
    chat_template: str | None = None  # a file overriding the model's template
    triton_model: str = "ensemble"

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name


@dataclass
class Sample:
    """One choice of the answer: a Triton request, its prompt's position and its output."""

    index: int
    prompt_index: int
    generation: Generation
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    offset: int = 0  # text length streamed so far (completions' text_offset)

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.log_probs += chunk.log_probs
        self.finish_reason = chunk.finish_reason or None
        self.num_input_tokens = chunk.num_input_tokens
        self.num_output_tokens = chunk.num_output_tokens


def usage(samples: Sequence[Sample]) -> dict[str, int]:
    """Prompt tokens once per prompt (not per sample), completion tokens of every sample."""
    prompt = {s.prompt_index: s.num_input_tokens for s in samples}
    prompt_tokens = sum(prompt.values())
    completion_tokens = sum(s.num_output_tokens for s in samples)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Gateway:
    """The state behind the routes: Triton bridge, tokenizer (log-prob token strings), chat
    template, served model name."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        self.chat_template = ChatTemplate.from_model_dir(
            config.model_dir, self.tokenizer, config.chat_template
        )
        self.bridge = TritonBridge(config.triton_url, config.triton_model)
        self.created = int(time.time())

    # --- routes ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not await self.bridge.is_ready():
            raise APIError(503, f"Triton at {self.config.triton_url} is not ready")
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedllm",
        }

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        body = parse_body(CompletionRequest, await _json(request))
        self._check_model(body.model)
        prompts = body.prompts()
        samples = self._samples(body, prompts, body.max_tokens, body.logprobs is not None)
        echo = prompts if body.echo else None
        builder = _CompletionBuilder(self, body, samples, echo)
        return await self._answer(request, body, samples, builder, "prompt")

    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await _json(request))
        self._check_model(body.model)
        if self.chat_template is None:
            raise bad_request(
                f"the model {self.model_name} has no chat template (start the gateway with "
                "--chat-template FILE)",
                "messages",
            )
        try:
            prompt = self.chat_template.render(body.template_messages())
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        samples = self._samples(body, [prompt], body.output_limit, body.logprobs)
        builder = _ChatBuilder(self, body, samples)
        return await self._answer(request, body, samples, builder, "messages")

    # --- helpers --------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                param="model",
                code="model_not_found",
            )

    def _samples(
        self, body: Any, prompts: list[str], max_tokens: int | None, logprobs: bool
    ) -> list[Sample]:
        if len(prompts) * body.n > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
        samples: list[Sample] = []
        for p, prompt in enumerate(prompts):
            for j in range(body.n):
                sampling = body.sampling(max_tokens)
                if body.seed is not None:
                    sampling["seed"] = body.seed + j
                if logprobs:
                    sampling["logprobs"] = 0
                generation = Generation(prompt, sampling, logprobs=logprobs)
                samples.append(Sample(len(samples), p, generation))
        return samples

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _answer(
        self,
        request: Request,
        body: Any,
        samples: list[Sample],
        builder: _Builder,
        prompt_param: str,
    ) -> Response:
        stream = merged(self.bridge, samples)
        try:
            if not body.stream:
                await until_disconnect(request, _collect(stream, samples))
                return JSONResponse(builder.final())
            first = await until_disconnect(request, _first_chunks(stream, len(samples)))
        except TritonError as e:
            await stream.aclose()
            raise _api_error(e, prompt_param) from None
        except BaseException:
            await stream.aclose()
            raise
        return _EventStream(_sse_body(builder, samples, first, stream, prompt_param))


class _Builder:
    """The response objects of one endpoint."""

    def __init__(self, gateway: Gateway, body: Any, samples: list[Sample], prefix: str) -> None:
        self.gateway = gateway
        self.body = body
        self.samples = samples
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.gateway.model_name,
        }

    def start(self) -> list[dict[str, Any]]:
        """Chunks sent before any generated text."""
        return []

    def chunk(self, sample: Sample, chunk: Chunk) -> dict[str, Any] | None:
        raise NotImplementedError

    def final(self) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self) -> dict[str, Any]:
        """The last streamed chunk when stream_options.include_usage is set."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage(self.samples)}

    def with_usage(self, data: dict[str, Any]) -> dict[str, Any]:
        # OpenAI sends "usage": null on every chunk when include_usage is set
        return {**data, "usage": None} if self.body.include_usage else data

    # the "object" of a streamed chunk
    chunk_object = ""

    def _chunk(
        self, index: int, content: dict[str, Any], logprobs: Any = None, finish: str | None = None
    ) -> dict[str, Any]:
        """A streamed chunk with one choice: `content` is its text or delta."""
        choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish}
        return self.with_usage({**self._head(self.chunk_object), "choices": [choice]})


class _CompletionBuilder(_Builder):
    chunk_object = "text_completion"

    def __init__(
        self,
        gateway: Gateway,
        body: CompletionRequest,
        samples: list[Sample],
        echo: list[str] | None,
    ) -> None:
        super().__init__(gateway, body, samples, "cmpl")
        self.echo = echo
        self.logprobs = body.logprobs is not None

    def _logprobs(self, sample: Sample, ids: list[int], lps: list[float]) -> dict[str, Any]:
        tokens = [self.gateway.token_text(i) for i in ids]
        offsets = []
        for token in tokens:
            offsets.append(sample.offset)
            sample.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)],
            "text_offset": offsets,
        }

    def start(self) -> list[dict[str, Any]]:
        if self.echo is None:
            return []
        return [self._chunk(s.index, {"text": self.echo[s.prompt_index]}) for s in self.samples]

    def chunk(self, sample: Sample, chunk: Chunk) -> dict[str, Any] | None:
        if not (chunk.text or chunk.finish_reason or (self.logprobs and chunk.token_ids)):
            return None
        logprobs = None
        if self.logprobs:
            logprobs = self._logprobs(sample, chunk.token_ids, chunk.log_probs)
        content = {"text": chunk.text}
        return self._chunk(sample.index, content, logprobs, chunk.finish_reason or None)

    def final(self) -> dict[str, Any]:
        choices = []
        for s in self.samples:
            text = "".join(s.text)
            if self.echo is not None:
                text = self.echo[s.prompt_index] + text
            logprobs = self._logprobs(s, s.token_ids, s.log_probs) if self.logprobs else None
            choices.append(
                {
                    "index": s.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": s.finish_reason,
                }
            )
        return {**self._head("text_completion"), "choices": choices, "usage": usage(self.samples)}


class _ChatBuilder(_Builder):
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, gateway: Gateway, body: ChatCompletionRequest, samples: list[Sample]
    ) -> None:
        super().__init__(gateway, body, samples, "chatcmpl")
        self.logprobs = body.logprobs

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict[str, Any]:
        content = []
        for token_id, lp in zip(ids, lps, strict=True):
            token = self.gateway.token_text(token_id)
            content.append(
                {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
            )
        return {"content": content}

    def start(self) -> list[dict[str, Any]]:
        first = {"delta": {"role": "assistant", "content": ""}}
        return [self._chunk(s.index, first) for s in self.samples]

    def chunk(self, sample: Sample, chunk: Chunk) -> dict[str, Any] | None:
        if not (chunk.text or chunk.finish_reason or (self.logprobs and chunk.token_ids)):
            return None
        delta = {"delta": {"content": chunk.text} if chunk.text else {}}
        logprobs = self._logprobs(chunk.token_ids, chunk.log_probs) if self.logprobs else None
        return self._chunk(sample.index, delta, logprobs, chunk.finish_reason or None)

    def final(self) -> dict[str, Any]:
        choices = [
            {
                "index": s.index,
                "message": {"role": "assistant", "content": "".join(s.text)},
                "logprobs": self._logprobs(s.token_ids, s.log_probs) if self.logprobs else None,
                "finish_reason": s.finish_reason,
            }
            for s in self.samples
        ]
        return {**self._head("chat.completion"), "choices": choices, "usage": usage(self.samples)}


# --- streams of several samples ------------------------------------------------------------


async def merged(
    bridge: TritonBridge, samples: list[Sample]
) -> AsyncGenerator[tuple[int, Chunk], None]:
    """(sample index, chunk) of every sample's generation, as they arrive. The first error is
    raised; closing the iterator (or an error) cancels the generations still running."""
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

    async def run(sample: Sample) -> None:
        try:
            async for chunk in bridge.generate(sample.generation):
                queue.put_nowait((sample.index, chunk))
        except Exception as e:
            queue.put_nowait((sample.index, e))
        finally:
            queue.put_nowait((sample.index, None))

    tasks = [asyncio.ensure_future(run(s)) for s in samples]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # each cancels its gRPC call (TritonBridge.generate)


async def _collect(stream: AsyncIterator[tuple[int, Chunk]], samples: list[Sample]) -> None:
    async for index, chunk in stream:
        samples[index].add(chunk)


async def _first_chunks(
    stream: AsyncIterator[tuple[int, Chunk]], count: int
) -> list[tuple[int, Chunk]]:
    """The chunks up to the first of every sample (all requests accepted by Triton)."""
    first: list[tuple[int, Chunk]] = []
    seen: set[int] = set()
    while len(seen) < count:
        index, chunk = await stream.__anext__()
        first.append((index, chunk))
        seen.add(index)
    return first


async def _sse_body(
    builder: _Builder,
    samples: list[Sample],
    first: list[tuple[int, Chunk]],
    stream: AsyncGenerator[tuple[int, Chunk], None],
    prompt_param: str,
) -> AsyncGenerator[str, None]:
    async def rest() -> AsyncIterator[tuple[int, Chunk]]:
        for item in first:
            yield item
        async for item in stream:
            yield item

    try:
        for data in builder.start():
            yield sse(data)
        async for index, chunk in rest():
            sample = samples[index]
            sample.add(chunk)
            event = builder.chunk(sample, chunk)
            if event is not None:
                yield sse(event)
        if builder.body.include_usage:
            yield sse(builder.usage_chunk())
    except TritonError as e:
        yield sse(_api_error(e, prompt_param).body())
    finally:
        # a client that went away closes this generator here: the Triton requests go too
        await stream.aclose()
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, also when
    the client disconnected while an event was being sent (Starlette then leaves it open)."""

    body_iterator: AsyncGenerator[str, None]

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or cancel it when the client disconnects first (the request body has
    been read, so the next ASGI message is the disconnect)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone()
    finally:
        watcher.cancel()
        task.cancel()
        # let the work unwind (its finally blocks cancel Triton requests) before going on
        await asyncio.wait({task, watcher})


class _ClientGone(Exception):
    pass


def _api_error(e: TritonError, prompt_param: str) -> APIError:
    param = None
    if e.status == 400:
        for name in _PARAMS:
            if re.search(rf"\b{name}\b", e.message):
                param = prompt_param if name == "prompt" else name
                break
        if param is None and ("context" in e.message or "empty" in e.message):
            param = prompt_param
    return APIError(e.status, e.message, param=param)


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


# --- the application -----------------------------------------------------------------------


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = APIError(exc.status_code, str(exc.detail))
    return JSONResponse(error.body(), status_code=exc.status_code)


async def _client_gone_response(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it


async def _server_error_response(request: Request, exc: Exception) -> Response:
    error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
    return JSONResponse(error.body(), status_code=500)


def create_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await gateway.bridge.close()

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        APIError: _api_error_response,
        HTTPException: _http_error_response,
        _ClientGone: _client_gone_response,
        Exception: _server_error_response,
    }
    app = Starlette(
        routes=[
            Route("/health", gateway.health, methods=["GET"]),
            Route("/v1/models", gateway.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", gateway.get_model, methods=["GET"]),
            Route("/v1/completions", gateway.completions, methods=["POST"]),
            Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
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
