"""vLLM's `use_beam_search` on /v1/completions: one Triton request per prompt with
`beam_width` = `n` (and `length_penalty`), its last response's beams (best first) the choices.
Triton's rule is vLLM's (docs/beam_search.md): `2 × n` candidates per beam, no early stop,
`ignore_eos` honoured; the beams rank by the raw log-probs, so the sampling fields play no
part. Without `logprobs`, stop strings or structured outputs (400s naming the field).

Never streamed, as vLLM (`serving_completion`: `stream = request.stream and ... and not
request.use_beam_search`): with `stream: true` the answer is the same JSON completion as
without (every streamed Triton response holds every beam whole, which OpenAI's deltas per choice
cannot carry, and beams reorder until the last step)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedllm.openai.errors import bad_request
from pagedllm.openai.samples import Sample
from pagedllm.openai.triton import Chunk, Generation

if TYPE_CHECKING:
    from pagedllm.openai.protocol import CompletionRequest, Prompt

MAX_BEAM_WIDTH = 10  # the engine's (2 x width log-probs each, at most 20)


def check_beam_search(body: Any) -> None:
    """What vLLM's beam search takes on /v1/completions and ours does not: 400 naming it."""
    if not 1 <= body.n <= MAX_BEAM_WIDTH:
        raise bad_request(f"use_beam_search: n (the beam width) must be 1-{MAX_BEAM_WIDTH}", "n")
    refused = {
        "logprobs": body.logprobs is not None,
        "stop": bool(body.stop),
        "prompt_logprobs": body.prompt_logprobs is not None,
        "logit_bias": bool(body.logit_bias),
        "allowed_token_ids": body.allowed_token_ids is not None,
        "min_tokens": bool(body.min_tokens),
    }
    if body.constraint is not None:
        refused[body.constraint.param] = True
    for param, sent in refused.items():
        if sent:
            raise bad_request(f"use_beam_search cannot be combined with {param}", param)


def beam_requests(
    body: CompletionRequest, prompts: list[Prompt], max_tokens: int | None
) -> list[Sample]:
    """One Triton request per prompt (width 1 is a greedy search)."""
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    for name in ("ignore_eos", "skip_special_tokens"):
        if (value := getattr(body, name)) is not None:
            sampling[name] = value
    width, penalty = body.n, body.length_penalty
    return [
        Sample(p, p, Generation(prompt, sampling, width, penalty))
        for p, prompt in enumerate(prompts)
    ]


async def beam_choices(
    stream: AsyncIterator[tuple[int, Chunk]], requests: list[Sample]
) -> list[Sample]:
    """Each prompt's beams of its last response, in prompt order: the choices."""
    last: dict[int, Chunk] = {}
    async for index, chunk in stream:
        last[index] = chunk
    choices: list[Sample] = []
    for request in requests:
        chunk = last[request.index]
        for beam in chunk.beams if chunk.beams is not None else [chunk]:
            choice = Sample(len(choices), request.prompt_index, request.generation)
            choice.add(beam)
            choices.append(choice)
    return choices
