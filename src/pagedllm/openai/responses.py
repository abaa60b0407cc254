"""The OpenAI response objects of one answer: the builders of the completions and chat
endpoints' chunks and final bodies, from each choice's accumulated output (`samples`).

Log-probs are shaped as vLLM's server shapes them. Completions: `tokens`, `token_logprobs`,
`top_logprobs` (per token a dict of token string -> log-prob: the chosen token, then the N best
ones; a string that two ids share keeps the later value) and `text_offset` (the token strings'
lengths added up); with `echo`, the prompt's tokens come first, the first one with `null`
log-prob and top. Chat: per token `{token, logprob, bytes, top_logprobs}`, `top_logprobs` the N
best `{token, logprob, bytes}`, best first (OpenAI's meaning). With `return_tokens_as_token_ids`
a token is spelled `token_id:N` (its `bytes` stay the token's own). A log-prob of -inf is shown
as -9999.0, as OpenAI and vLLM do.

vLLM's extras: `prompt_logprobs` (per prompt token `{"<id>": {logprob, rank, decoded_token}}`,
the prompt's token first, then the N best; `null` for the first token) and, with
`return_token_ids`, `prompt_token_ids` and `token_ids` — on each completions choice; on a chat
answer `prompt_logprobs` and `prompt_token_ids` are the response's (vLLM's places), `token_ids`
each choice's. Streamed, a chunk's `token_ids` are its new ids and a choice's first chunk (a
chat answer's first chunks) carries the prompt's ids. All `null` when not asked.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagedllm.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.openai.samples import Sample, usage
from pagedllm.openai.tokens import TokenTexts
from pagedllm.openai.tool_parser import ToolCallParser
from pagedllm.openai.tools import ToolUse
from pagedllm.openai.triton import Chunk, TokenLogprob, TritonError

# what a log-prob of -inf is shown as (JSON has no infinity)
MIN_LOGPROB = -9999.0


def shown(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


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
        self.return_ids = bool(body.return_token_ids)
        self.as_ids = bool(body.return_tokens_as_token_ids)

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model_name,
        }

    def name(self, token_id: int) -> str:
        """A token as log-probs show it: its text, or `token_id:N`."""
        return f"token_id:{token_id}" if self.as_ids else self.tokens.text(token_id)

    def prompt_logprobs(self, sample: Sample) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token its id -> {logprob, rank, decoded_token},
        then the N best (ranks 1..N); None for the first token."""
        if sample.prompt_logprobs is None:
            return None
        out: list[dict[str, Any] | None] = []
        for entry in sample.prompt_logprobs:
            if entry.logprob is None:
                out.append(None)
                continue
            d = {str(entry.token_id): self._logprob(entry.token_id, entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top, start=1):
                d.setdefault(str(token_id), self._logprob(token_id, logprob, rank))
            out.append(d)
        return out

    def _logprob(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {
            "logprob": shown(logprob),
            "rank": rank,
            "decoded_token": self.tokens.text(token_id),
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

    def with_usage(self, data: dict[str, Any], sample: Sample) -> dict[str, Any]:
        # OpenAI sends "usage": null on every chunk when include_usage is set; vLLM's
        # continuous_usage_stats: the choice's usage so far
        if self.body.continuous_usage:
            return {**data, "usage": sample.chunk_usage()}
        return {**data, "usage": None} if self.body.include_usage else data

    # the "object" of a streamed chunk
    chunk_object = ""

    def _chunk(
        self,
        sample: Sample,
        content: dict[str, Any],
        logprobs: Any = None,
        finish: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A streamed chunk with one choice: `content` is its text or delta, `extra` more
        fields of the choice."""
        choice = {"index": sample.index, **content, "logprobs": logprobs, "finish_reason": finish}
        data = {**self._head(self.chunk_object), "choices": [{**choice, **(extra or {})}]}
        return self.with_usage(data, sample)

    def _new_ids(self, chunk: Chunk) -> list[int] | None:
        return chunk.token_ids if self.return_ids else None


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
            token = self.name(entry.token_id)
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
                    top[self.name(token_id)] = shown(logprob)
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _prompt_entries(self, sample: Sample) -> list[TokenLogprob]:
        if sample.prompt_logprobs is None:
            raise TritonError(502, "Triton's response carries no prompt log-probs (for echo)")
        return sample.prompt_logprobs

    def _ids(self, sample: Sample, token_ids: list[int] | None) -> dict[str, Any]:
        """vLLM's `prompt_token_ids` (a streamed choice's first chunk) and `token_ids`."""
        prompt_ids = None
        if self.return_ids and not sample.ids_sent:
            prompt_ids, sample.ids_sent = sample.prompt_token_ids, True
        return {"prompt_token_ids": prompt_ids, "token_ids": token_ids}

    def chunk(self, sample: Sample, chunk: Chunk) -> dict[str, Any] | None:
        # an echoed prompt goes out with the sample's first response, as vLLM sends it
        echo = None if self.echo is None or sample.echoed else self.echo[sample.prompt_index]
        text, entries = chunk.text, chunk.logprobs
        if echo is not None:
            sample.echoed = True
            text = echo + text
            if self.logprobs:
                entries = self._prompt_entries(sample) + entries
        new_ids = self._new_ids(chunk)
        if not (
            echo is not None
            or text
            or chunk.finish_reason
            or (self.logprobs and entries)
            or new_ids
            or (self.return_ids and not sample.ids_sent)
        ):
            return None
        logprobs = self._logprobs(sample, entries) if self.logprobs else None
        finish = chunk.finish_reason or None
        return self._chunk(sample, {"text": text}, logprobs, finish, self._ids(sample, new_ids))

    def final(self) -> dict[str, Any]:
        choices = []
        for s in self.samples:
            text, entries = "".join(s.text), s.logprobs
            if self.echo is not None:
                text = self.echo[s.prompt_index] + text
                if self.logprobs:
                    entries = self._prompt_entries(s) + entries
            choices.append(
                {
                    "index": s.index,
                    "text": text,
                    "logprobs": self._logprobs(s, entries) if self.logprobs else None,
                    "finish_reason": s.finish_reason,
                    "prompt_logprobs": self.prompt_logprobs(s),
                    "prompt_token_ids": s.prompt_token_ids if self.return_ids else None,
                    "token_ids": s.token_ids if self.return_ids else None,
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
        role: str = "assistant",
        echo: str | None = None,
    ) -> None:
        super().__init__(model_name, tokens, body, samples, "chatcmpl")
        self.logprobs = body.logprobs
        self.tools = tools  # the output is read for tool calls
        self.role = role  # the answer's (vLLM: the last message's without a generation prompt)
        self.echo = echo or ""  # the last message's content, put before the answer's
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
            "token": self.name(token_id),
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
        first = {"delta": {"role": self.role, "content": ""}}
        chunks = []
        for s in self.samples:
            chunk = self._chunk(s, first)
            if self.return_ids:  # the prompt's ids on the first chunks (vLLM's place)
                chunk["prompt_token_ids"] = s.prompt_token_ids
            chunks.append(chunk)
        if self.echo:  # vLLM sends the echoed content in chunks of its own
            chunks += [self._chunk(s, {"delta": {"content": self.echo}}) for s in self.samples]
        return chunks

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
        new_ids = self._new_ids(chunk)
        if not (delta or chunk.finish_reason or (self.logprobs and chunk.logprobs) or new_ids):
            return None
        logprobs = self._logprobs(chunk.logprobs) if self.logprobs else None
        finish = self._finish(chunk.finish_reason or None, parser)
        return self._chunk(sample, {"delta": delta}, logprobs, finish, {"token_ids": new_ids})

    def _message(self, sample: Sample) -> tuple[dict[str, Any], str | None]:
        """A choice's message and finish reason."""
        text = "".join(sample.text)
        if self.tools is None:
            return {"role": self.role, "content": self.echo + text}, sample.finish_reason
        parser = self._parser()
        parser.feed(text)
        parser.finish()
        content = parser.content
        if self.echo:
            content = self.echo + (content or "")
        message: dict[str, Any] = {"role": self.role, "content": content}
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
                    "token_ids": s.token_ids if self.return_ids else None,
                }
            )
        first = self.samples[0]
        return {
            **self._head("chat.completion"),
            "choices": choices,
            "usage": usage(self.samples),
            "prompt_logprobs": self.prompt_logprobs(first),
            "prompt_token_ids": first.prompt_token_ids if self.return_ids else None,
        }
