"""Beam search's public vocabulary and rule, as vLLM's (`vllm/beam_search.py`,
`LLM.beam_search`): the parameters, the sequences returned, the score and one step's choice.

vLLM's rule, step by step: every live beam proposes its `2 * beam_width` most likely next
tokens (log-probs of the raw logits; with a temperature the sampled token joins them); a
candidate ending in EOS becomes a finished hypothesis, the others are ranked by cumulative
log-prob and the best `beam_width` live on. No early stop: after `max_tokens` steps the
finished and live hypotheses are ranked together by `get_beam_search_score`, whose length is
the whole sequence, prompt included (HF divides by the output length; see docs/beam_search.md).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from pagedllm.convert import to_bool

# (parent beam's index, token id, the token's log-prob), one per candidate
Candidate = tuple[int, int, float]


@dataclass
class BeamSearchParams:
    """vLLM's names and defaults. `include_stop_str_in_output` is accepted as vLLM's offline
    API accepts it: `LLM.beam_search` returns the whole sequence as text either way.
    `early_stopping` (not vLLM's): None keeps vLLM's rule; True, False or "never" runs HF's
    (and TensorRT-LLM's) rule with that stop (`pagedllm.beam_hf`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str | None = None

    def __post_init__(self) -> None:
        self.beam_width = int(self.beam_width)
        self.max_tokens = int(self.max_tokens)
        self.temperature = float(self.temperature)
        self.length_penalty = float(self.length_penalty)
        self.ignore_eos = to_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = to_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        stop = self.early_stopping
        if not (stop is None or isinstance(stop, bool) or stop == "never"):
            raise ValueError(
                f'early_stopping must be True, False or "never", got {self.early_stopping!r}'
            )
        if self.early_stopping is not None and self.temperature > 0:
            raise ValueError("early_stopping (HF's rule) ranks by log-probs: temperature must be 0")

    @property
    def num_candidates(self) -> int:
        """How many next tokens each beam proposes (vLLM's and HF's 2 * width)."""
        return 2 * self.beam_width


@dataclass
class BeamSearchSequence:
    """One hypothesis: `tokens` holds the prompt and the output; `logprobs` one dict per
    output token, the candidates its parent proposed then (token id -> log-prob)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length", once returned


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int],
    cumulative_logprob: float,
    eos_token_ids: Collection[int],
    length_penalty: float = 1.0,
) -> float:
    """vLLM's score: the cumulative log-prob over the sequence's length (prompt included; a
    final EOS not counted) to the power `length_penalty`."""
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def select_candidates(
    cum_logprobs: Sequence[float],
    proposals: Sequence[Sequence[tuple[int, float]]],
    width: int,
    eos_token_ids: Collection[int],
) -> tuple[list[Candidate], list[Candidate]]:
    """One step of vLLM's rule. `proposals[i]`: beam i's (token, log-prob) candidates.
    Returns (the next live beams, best first, at most `width`; the EOS candidates, which end
    as finished hypotheses), each as (parent index, token, cumulative log-prob). Pass an
    empty `eos_token_ids` to ignore EOS. Ties keep the parents' order (a stable sort)."""
    live: list[Candidate] = []
    ended: list[Candidate] = []
    for parent, (cum, cands) in enumerate(zip(cum_logprobs, proposals, strict=True)):
        for token, logprob in cands:
            (ended if token in eos_token_ids else live).append((parent, token, cum + logprob))
    live.sort(key=lambda c: c[2], reverse=True)
    return live[:width], ended
