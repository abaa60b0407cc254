"""Each choice's output as its Triton responses accumulate (`Sample`), and the answer's usage.

`usage.prompt_tokens` counts each prompt once (with `n` > 1 its samples share it), from its
first sample; `prompt_tokens_details.cached_tokens` likewise counts the prompt tokens the
engine's prefix cache served (its last response says how many); `completion_tokens` adds up
every sample's. With vLLM's `continuous_usage_stats` every streamed chunk carries its choice's
usage so far (`chunk_usage`), as vLLM sends it: that prompt's tokens and that choice's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.openai.errors import bad_request
from pagedllm.openai.triton import Chunk, Generation, TokenLogprob

# requests answering more choices than this (prompts x n) are refused
MAX_CHOICES = 64


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
    num_cached_tokens: int | None = None  # known from the last response
    offset: int = 0  # length of the token strings shown so far (completions' text_offset)
    echoed: bool = False  # the prompt went out (a streamed echo)
    ids_sent: bool = False  # its prompt's token ids went out (streamed return_token_ids)

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.finish_reason = chunk.finish_reason or None
        self.num_input_tokens = chunk.num_input_tokens
        self.num_output_tokens = chunk.num_output_tokens
        if chunk.num_cached_tokens is not None:
            self.num_cached_tokens = chunk.num_cached_tokens

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt's ids: those sent (a token-id prompt, or one the gateway tokenized), or
        those the engine's prompt log-probs name; None when neither is known."""
        if isinstance(self.generation.prompt, list):
            return self.generation.prompt
        if self.prompt_logprobs is not None:
            return [entry.token_id for entry in self.prompt_logprobs]
        return None

    def chunk_usage(self) -> dict[str, int]:
        """The usage so far of this choice (vLLM's `continuous_usage_stats`)."""
        return {
            "prompt_tokens": self.num_input_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_input_tokens + self.num_output_tokens,
        }


def make_samples(
    body: Any,
    prompts: Sequence[str | list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    extra: dict[str, Any] | None = None,
) -> list[Sample]:
    """One Triton request per prompt and sample of `body` (a completion or chat request);
    `logprobs` / `prompt_logprobs`: the top alternatives per generated / prompt token (None:
    no log-probs); `extra`: more sampling parameters (a constraint's `structured_outputs`)."""
    if len(prompts) * body.n > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
    samples: list[Sample] = []
    for p, prompt in enumerate(prompts):
        for j in range(body.n):
            sampling = body.sampling(max_tokens)
            if body.seed is not None:
                sampling["seed"] = body.seed + j
            if logprobs is not None:
                sampling["logprobs"] = logprobs
            if prompt_logprobs is not None:
                sampling["prompt_logprobs"] = prompt_logprobs
            sampling.update(extra or {})
            samples.append(Sample(len(samples), p, Generation(prompt, sampling)))
    return samples


def usage(samples: Sequence[Sample]) -> dict[str, Any]:
    """Prompt tokens (and cached ones) once per prompt, completion tokens of every sample."""
    first: dict[int, Sample] = {}
    for s in samples:
        first.setdefault(s.prompt_index, s)
    prompt_tokens = sum(s.num_input_tokens for s in first.values())
    cached = sum(s.num_cached_tokens or 0 for s in first.values())
    completion_tokens = sum(s.num_output_tokens for s in samples)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
