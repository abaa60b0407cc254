"""Beam search with an early stop: HF transformers' rule (`generate(num_beams, early_stopping)`,
its `_beam_search`), which TensorRT-LLM's beam search kernels follow too (its `early_stopping`
1 / 0 / other = HF's True / False / "never").

It differs from vLLM's rule (`pagedllm.beam_search`), which a `BeamSearchParams` without
`early_stopping` keeps:

- each step the `K = max(2, 1 + #EOS ids) * width` best candidates over all beams are taken;
  an EOS candidate becomes a finished hypothesis only if it ranks among the first `width` of
  them (vLLM keeps every EOS candidate), and the best `width` others live on;
- at most `width` finished hypotheses are kept, ranked by `cum_logprob / output_len **
  length_penalty`, the **output** length counting the EOS (vLLM: prompt + output, without it);
- the search stops early: `True` once `width` hypotheses have finished; `False` once they have
  and the best live beam's score at the current length cannot beat the worst of them; "never"
  likewise but, with `length_penalty > 0`, at the longest length (`max_tokens`). At
  `max_tokens` the `width` best candidates of the last step (EOS or not) finish.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from pagedllm.beam_search import BeamSearchSequence, Candidate

EARLY_STOPPING = (True, False, "never")


def hf_num_candidates(width: int, num_eos: int) -> int:
    """HF's K: enough candidates that `width` of them are not EOS."""
    return max(2, 1 + num_eos) * width


def hf_select(
    cum_logprobs: Sequence[float],
    proposals: Sequence[Sequence[tuple[int, float]]],
    width: int,
    eos_token_ids: Collection[int],
    last: bool,
) -> tuple[list[Candidate], list[Candidate]]:
    """One step of HF's rule. Returns (the next live beams, best first; the candidates that
    finish now: an EOS among the first `width`, or at the last step all of the first
    `width`), each as (parent index, token, cumulative log-prob). Ties keep the parents'
    order (a stable sort)."""
    cands = [
        (parent, token, cum + logprob)
        for parent, (cum, props) in enumerate(zip(cum_logprobs, proposals, strict=True))
        for token, logprob in props
    ]
    cands.sort(key=lambda c: c[2], reverse=True)
    cands = cands[: hf_num_candidates(width, len(eos_token_ids))]
    if last:
        return [], cands[:width]
    ended = [c for c in cands[:width] if c[1] in eos_token_ids]
    live = [c for c in cands if c[1] not in eos_token_ids][:width]
    return live, ended


@dataclass
class Hypotheses:
    """HF's finished hypotheses of one search (at most `width`, best first) and its stop
    test."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    kept: list[tuple[float, BeamSearchSequence]] = field(default_factory=list)
    # HF's is_early_stop_heuristic_unsatisfied: once False, nothing is added any more
    improvable: bool = True

    def score(self, cum_logprob: float, num_output: int) -> float:
        return cum_logprob / num_output**self.length_penalty

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.width

    def accepting(self) -> bool:
        """Whether this step's finished candidates may join (asked before adding any)."""
        return self.improvable and not (self.full and self.early_stopping is True)

    def add(self, seqs: list[tuple[BeamSearchSequence, int]]) -> None:
        """This step's finished candidates, each with its output length."""
        for seq, num_output in seqs:
            self.kept.append((self.score(seq.cum_logprob, num_output), seq))
        self.kept.sort(key=lambda k: k[0], reverse=True)  # stable: the earlier first on ties
        del self.kept[self.width :]

    def done(self, best_live_cum: float | None, num_output: int) -> bool:
        """After a step that leaves `num_output` tokens per beam: whether the search stops."""
        if best_live_cum is None or num_output >= self.max_tokens:
            return True
        if not self.full:
            return False
        if self.early_stopping is True:
            return True
        best_len = num_output
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_len = self.max_tokens
        best_possible = best_live_cum / best_len**self.length_penalty
        self.improvable = self.improvable and best_possible > self.kept[-1][0]
        return not self.improvable

    def sequences(self) -> list[BeamSearchSequence]:
        return [seq for _, seq in self.kept]
