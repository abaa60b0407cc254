"""vLLM's `use_beam_search` on /v1/completions: one Triton request per prompt with
`beam_width` = `n` (and `length_penalty`), its last response's beams (best first) the choices.
Triton's rule is vLLM's (docs/beam_search.md): `2 × n` candidates per beam, no early stop,
`ignore_eos` honoured; the beams rank by the raw log-probs, so the sampling fields play no
part. Without `logprobs`, stop strings or structured outputs (400s naming the field:
`protocol.check_beam_search`).

Never streamed, as vLLM (`serving_completion`: `stream = request.stream and ... and not
request.use_beam_search`): with `stream: true` the answer is the same JSON completion as
without (every streamed Triton response holds every beam whole, which OpenAI's deltas per choice
cannot carry, and beams reorder until the last step)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pagedllm.openai.protocol import CompletionRequest, Prompt
from pagedllm.openai.samples import Sample
from pagedllm.openai.triton import Chunk, Generation


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
