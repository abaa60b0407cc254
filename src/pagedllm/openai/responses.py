"""The OpenAI response objects of one answer: each choice's accumulated output (`Sample`) and
the builders of the completions and chat endpoints' chunks and final bodies."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.openai.triton import Chunk, Generation


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


class Builder:
    """The response objects of one endpoint."""

    def __init__(
        self,
        model_name: str,
        token_text: Callable[[int], str],
        body: Any,
        samples: list[Sample],
        prefix: str,
    ) -> None:
        self.model_name = model_name
        self.token_text = token_text  # a token id's string, for log-probs
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
        token_text: Callable[[int], str],
        body: CompletionRequest,
        samples: list[Sample],
        echo: list[str] | None,
    ) -> None:
        super().__init__(model_name, token_text, body, samples, "cmpl")
        self.echo = echo
        self.logprobs = body.logprobs is not None

    def _logprobs(self, sample: Sample, ids: list[int], lps: list[float]) -> dict[str, Any]:
        tokens = [self.token_text(i) for i in ids]
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


class ChatBuilder(Builder):
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        model_name: str,
        token_text: Callable[[int], str],
        body: ChatCompletionRequest,
        samples: list[Sample],
    ) -> None:
        super().__init__(model_name, token_text, body, samples, "chatcmpl")
        self.logprobs = body.logprobs

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict[str, Any]:
        content = []
        for token_id, lp in zip(ids, lps, strict=True):
            token = self.token_text(token_id)
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
