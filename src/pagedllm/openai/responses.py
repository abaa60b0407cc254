"""The OpenAI response objects of one answer: each choice's accumulated output (`Sample`) and
the builders of the completions and chat endpoints' chunks and final bodies.

Log-probs are shaped as vLLM's server shapes them. Completions: `tokens`, `token_logprobs`,
`top_logprobs` (per token a dict of token string -> log-prob: the chosen token, then the N best
ones; a string that two ids share keeps the later value) and `text_offset` (the token strings'
lengths added up); with `echo`, the prompt's tokens come first, the first one with `null`
log-prob and top. Chat: per token `{token, logprob, bytes, top_logprobs}`, `top_logprobs` the N
best `{token, logprob, bytes}`, best first (OpenAI's meaning). A log-prob of -inf is shown as
-9999.0, as OpenAI and vLLM do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.openai.tokens import TokenTexts
from pagedllm.openai.tool_parser import ToolCallParser
from pagedllm.openai.tools import ToolUse
from pagedllm.openai.triton import Chunk, Generation, TokenLogprob, TritonError

# what a log-prob of -inf is shown as (JSON has no infinity)
MIN_LOGPROB = -9999.0


def shown(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


@dataclass
class Sample:
    """One choice of the answer: a Triton request, its prompt's position and its output."""

    index: int
    prompt_index: int
    generation: Generation
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    offset: int = 0  # length of the token strings shown so far (completions' text_offset)
    echoed: bool = False  # the prompt went out (a streamed echo)

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
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


class Builder:
    """The response objects of one endpoint."""

    def __init__(
        self, model_name: str, tokens: TokenTexts, body: Any, samples: list[Sample], prefix: str
    ) -> None:
        self.model_name = model_name
        self.tokens = tokens  # token strings and bytes, for log-probs
        self.body = body
        self.samples = samples
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model_name,
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


class CompletionBuilder(Builder):
    chunk_object = "text_completion"

    def __init__(
        self,
        model_name: str,
        tokens: TokenTexts,
        body: CompletionRequest,
        samples: list[Sample],
        echo: list[str] | None,
    ) -> None:
        super().__init__(model_name, tokens, body, samples, "cmpl")
        self.echo = echo  # each prompt's text, when echoed
        self.logprobs = body.logprobs is not None

    def _logprobs(self, sample: Sample, entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for entry in entries:
            token = self.tokens.text(entry.token_id)
            tokens.append(token)
            offsets.append(sample.offset)
            sample.offset += len(token)
            if entry.logprob is None:  # a prompt's first token
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(shown(entry.logprob))
            # vLLM: the chosen token, then the N best (each id once), keyed by string
            top = {token: shown(entry.logprob)}
            for token_id, logprob in entry.top:
                if token_id != entry.token_id:
                    top[self.tokens.text(token_id)] = shown(logprob)
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, sample: Sample) -> list[TokenLogprob]:
        if sample.prompt_logprobs is None:
            raise TritonError(502, "Triton's response carries no prompt log-probs (for echo)")
        return sample.prompt_logprobs

    def chunk(self, sample: Sample, chunk: Chunk) -> dict[str, Any] | None:
        # an echoed prompt goes out with the sample's first response, as vLLM sends it
        echo = None if self.echo is None or sample.echoed else self.echo[sample.prompt_index]
        text, entries = chunk.text, chunk.logprobs
        if echo is not None:
            sample.echoed = True
            text = echo + text
            if self.logprobs:
                entries = self._prompt_logprobs(sample) + entries
        if not (echo is not None or text or chunk.finish_reason or (self.logprobs and entries)):
            return None
        logprobs = self._logprobs(sample, entries) if self.logprobs else None
        return self._chunk(sample.index, {"text": text}, logprobs, chunk.finish_reason or None)

    def final(self) -> dict[str, Any]:
        choices = []
        for s in self.samples:
            text, entries = "".join(s.text), s.logprobs
            if self.echo is not None:
                text = self.echo[s.prompt_index] + text
                if self.logprobs:
                    entries = self._prompt_logprobs(s) + entries
            choices.append(
                {
                    "index": s.index,
                    "text": text,
                    "logprobs": self._logprobs(s, entries) if self.logprobs else None,
                    "finish_reason": s.finish_reason,
                }
            )
        return {**self._head("text_completion"), "choices": choices, "usage": usage(self.samples)}


class ChatBuilder(Builder):
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        model_name: str,
        tokens: TokenTexts,
        body: ChatCompletionRequest,
        samples: list[Sample],
        tools: ToolUse | None = None,
    ) -> None:
        super().__init__(model_name, tokens, body, samples, "chatcmpl")
        self.logprobs = body.logprobs
        self.tools = tools  # the output is read for tool calls
        # each streamed choice's calls, read as its text comes
        self.parsers = {s.index: self._parser() for s in samples} if tools else {}

    def _parser(self) -> ToolCallParser:
        assert self.tools is not None
        return ToolCallParser(self.tools.parallel)

    @staticmethod
    def _finish(reason: str | None, parser: ToolCallParser | None) -> str | None:
        # a generation that ended on its own after calls ends with them (OpenAI's reason)
        return "tool_calls" if reason == "stop" and parser and parser.calls else reason

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.tokens.text(token_id),
            "logprob": shown(logprob),
            "bytes": self.tokens.raw_bytes(token_id),
        }

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for entry in entries:
            assert entry.logprob is not None  # generated tokens all have one
            top = [self._token(token_id, logprob) for token_id, logprob in entry.top]
            content.append({**self._token(entry.token_id, entry.logprob), "top_logprobs": top})
        return {"content": content}

    def start(self) -> list[dict[str, Any]]:
        first = {"delta": {"role": "assistant", "content": ""}}
        return [self._chunk(s.index, first) for s in self.samples]

    def chunk(self, sample: Sample, chunk: Chunk) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
        parser = self.parsers.get(sample.index)
        if parser is not None:  # the text goes through the tool-call parser
            read = parser.feed(chunk.text)
            if chunk.finish_reason:
                end = parser.finish()
                read.content += end.content
            delta = {"content": read.content} if read.content else {}
            if read.calls:
                delta["tool_calls"] = read.calls
        if not (delta or chunk.finish_reason or (self.logprobs and chunk.logprobs)):
            return None
        logprobs = self._logprobs(chunk.logprobs) if self.logprobs else None
        finish = self._finish(chunk.finish_reason or None, parser)
        return self._chunk(sample.index, {"delta": delta}, logprobs, finish)

    def _message(self, sample: Sample) -> tuple[dict[str, Any], str | None]:
        """A choice's message and finish reason."""
        text = "".join(sample.text)
        if self.tools is None:
            return {"role": "assistant", "content": text}, sample.finish_reason
        parser = self._parser()
        parser.feed(text)
        parser.finish()
        message: dict[str, Any] = {"role": "assistant", "content": parser.content}
        if parser.calls:
            message["tool_calls"] = [call.message() for call in parser.calls]
        return message, self._finish(sample.finish_reason, parser)

    def final(self) -> dict[str, Any]:
        choices = []
        for s in self.samples:
            message, finish = self._message(s)
            logprobs = self._logprobs(s.logprobs) if self.logprobs else None
            choices.append(
                {
                    "index": s.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            )
        return {**self._head("chat.completion"), "choices": choices, "usage": usage(self.samples)}
