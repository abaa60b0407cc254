"""Beam search over Triton (TensorRT-LLM's `beam_width`): the request's beam parameters, and
each engine update (every live beam so far, or the final ranking) as a `RequestOutput` with one
`CompletionOutput` per beam, best first, whose text and tokens are the beam's **whole** output
so far (streamed responses repeat every beam: beams fork and reorder, so deltas would not add
up). `engine_stream.Stream` sends it as the n > 1 outputs are sent: `text_output` [beam],
`cum_log_probs` [beam], `output_log_probs` / `output_token_ids` the beams one after another,
`sequence_lengths` [beam].

The rule is vLLM's (docs/beam_search.md): `length_penalty` divides by the whole sequence's
length, prompt included, and there is no early stop; unless the request sends TensorRT-LLM's
`early_stopping`, which runs HF's and TensorRT-LLM's rule (`pagedllm.beam_hf`: scores by the
output length, stops as asked). The beams rank by the raw logits' log-probs, whatever the
sampling settings (temperature, top_k, top_p, seed)."""

from __future__ import annotations

from pagedllm.beam_search import BeamSearchParams, BeamSearchSequence
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.text.tokenizer import Tokenizer

# SamplingParams settings a beam search cannot honour, as (field, its default, why)
REFUSED: tuple[tuple[str, object, str], ...] = (
    ("n", 1, "n / num_return_sequences must be 1: every beam is returned"),
    ("stop", [], "stop strings"),
    ("stop_token_ids", [], "stop_token_ids / end_id"),
    ("bad_words", [], "bad_words"),
    ("bad_words_ids", [], "bad_words"),
    ("structured_outputs", None, "structured outputs (a grammar per beam is not supported)"),
    ("prompt_logprobs", None, "prompt log-probs"),
    ("min_tokens", 0, "min_tokens"),
    ("logit_bias", None, "logit_bias"),
    ("allowed_token_ids", None, "allowed_token_ids"),
)


def beam_params(
    params: SamplingParams,
    width: int,
    length_penalty: float,
    early_stopping: bool | str | None = None,
) -> BeamSearchParams:
    """The beam search a request asks for (`beam_width` > 1): vLLM's rule, or with
    `early_stopping` HF's and TensorRT-LLM's (`pagedllm.beam_hf`). Raises ValueError naming
    what cannot go with it."""
    for name, default, what in REFUSED:
        if getattr(params, name) not in (default, None):
            raise ValueError(f"beam_width > 1 cannot be combined with {what}")
    if params.logprobs:
        raise ValueError("beam_width > 1 cannot be combined with top log-probs (top_logprobs)")
    if params.max_tokens is None:
        raise ValueError("beam_width > 1 needs max_tokens")
    # NOTE: beams rank by the raw logits' log-probs; the sampling settings (temperature,
    # top_k, top_p, seed) play no part
    return BeamSearchParams(
        beam_width=width,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )


def beam_output(
    request_id: str,
    prompt_ids: list[int],
    sequences: list[BeamSearchSequence],
    finished: bool,
    tokenizer: Tokenizer,
    skip_special_tokens: bool = True,
) -> RequestOutput:
    """The beams (best first) as one output per beam: its output tokens and their text,
    cumulative log-prob and the chosen tokens' log-probs (ranked among the candidates)."""
    outputs = []
    for k, seq in enumerate(sequences):
        tokens = seq.tokens[len(prompt_ids) :]
        entries = [_entry(token, cands) for token, cands in zip(tokens, seq.logprobs, strict=True)]
        outputs.append(
            CompletionOutput(
                index=k,
                text=tokenizer.decode(tokens, skip_special_tokens),
                token_ids=tokens,
                cumulative_logprob=seq.cum_logprob,
                logprobs=entries,
                finish_reason=(seq.finish_reason or "length") if finished else None,
            )
        )
    return RequestOutput(request_id, None, prompt_ids, outputs, finished)


def _entry(token: int, candidates: dict[int, float]) -> dict[int, Logprob]:
    value = candidates[token]
    return {token: Logprob(value, 1 + sum(v > value for v in candidates.values()))}
