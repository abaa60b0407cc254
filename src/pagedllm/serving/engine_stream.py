"""One request's responses in the window protocol that `llm_engine` speaks to the stateless
`detokenizer` model (DESIGN.md facts 1-4). Tensors (each costs shared memory and copies on
every hop, and there is one response per token, so the optional ones go only when asked):

- `ids` = window ids + new ids: the new ids are those whose text this response adds, the
  window up to `CONTEXT` output ids before them, so the detokenizer decodes them in context
  (`text.detokenizer.window_text`);
- `meta` (`META` order): the window's length, `final` (flush an unfinished character),
  `skip_special_tokens`, and, for the client, `num_input_tokens`, `num_output_tokens`, `index`
  (0, 1, ... per response) and, on the last response when asked, the queue time and the time
  to first token; `probe`; `extra` (`codec.Extra`: which output set the client gets);
- `strings`: `text`, put first by the detokenizer — the prompt of a non-streamed output
  (unless `exclude_input_in_output`), or, for requests with stop strings or n > 1, the whole
  new text (those are detokenized in the engine: only the engine can stop on text, fact 4;
  every other request is decoded by the detokenizer, off the engine thread); `finish_reason`;
  `request_id`, the engine's id — 128 random bits, so that only the pipeline (and a direct
  client, for its own request) knows it — which the detokenizer sends back when the client
  cancelled (a cancelled ensemble request is not seen by this step, fact 5); then a `text`,
  `finish_reason` pair per further sequence (n > 1, not streamed);
- passed through to the client: `output_token_ids` (the ids generated in this response, the
  stop token included) and `output_log_probs` (their log-probs, when asked);
- when log-probs were asked for: `output_ranks` (the chosen tokens' ranks), `cum_log_probs`,
  and with N > 0 alternatives `output_top_token_ids` / `output_top_log_probs` (T, N); on the
  first response when prompt log-probs were asked for, `prompt_token_ids` (L),
  `prompt_log_probs` (L - 1: from the second prompt token on) and `prompt_top_token_ids` /
  `prompt_top_log_probs` (L - 1, N) and `prompt_ranks` (L - 1: each prompt token's rank);
  for n > 1 not streamed, `sequence_lengths`;
- on the last response: `num_cached_tokens` (the prompt tokens whose KV came from the prefix
  cache).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from pagedllm.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from pagedllm.serving.errors import Code
from pagedllm.text.detokenizer import CONTEXT

Tensors = dict[str, np.ndarray]
# the `meta` tensor's fields, in order
META = (
    "window_len",
    "final",
    "skip_special_tokens",
    "num_input_tokens",
    "num_output_tokens",
    "index",
    "queue_time_us",  # -1 unless this is the last response of a request that asked for timing
    "time_to_first_token_us",
    "probe",  # 1: a probe (see above), nothing to show
    "extra",  # `codec.Extra`: which outputs the client gets beyond pagedllm's own
    "sequence_index",  # n > 1, streamed: the sequence this response is about; else -1
)
# send(tensors, final) / fail(message, code): the adapter turns them into Triton responses
Send = Callable[[Tensors, bool], None]
Fail = Callable[[str, Code], None]
IsCancelled = Callable[[], bool]


def _ints(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _top(entries: SampleLogprobs, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, n) ids and log-probs of the n best tokens at each position, best first (each entry
    holds the chosen token, then the top ones: the chosen one only once)."""
    ids = np.zeros((len(entries), n), dtype=np.int32)
    values = np.zeros((len(entries), n), dtype=np.float32)
    for row, d in enumerate(entries):
        best = sorted(d.items(), key=lambda item: item[1].rank)[:n]
        ids[row, : len(best)] = [t for t, _ in best]
        values[row, : len(best)] = [lp.logprob for _, lp in best]
    return ids, values


def _prompt_tensors(prompt_ids: list[int], entries: PromptLogprobs, n: int) -> Tensors:
    """The prompt's log-probs (from its second token on) and their n top alternatives."""
    scored = [d for d in entries[1:] if d is not None]
    ids, values = _top(scored, n)
    chosen = [next(iter(d.values())) for d in scored]  # the prompt token first
    return {
        "prompt_token_ids": _ints(prompt_ids),
        "prompt_log_probs": np.array([lp.logprob for lp in chosen], dtype=np.float32),
        "prompt_ranks": _ints([lp.rank for lp in chosen]),
        "prompt_top_token_ids": ids,
        "prompt_top_log_probs": values,
    }


def _cached(out: RequestOutput) -> Tensors:
    """The last response's `num_cached_tokens`."""
    if not out.finished:
        return {}
    return {"num_cached_tokens": np.array([out.num_cached_tokens], dtype=np.uint32)}


@dataclasses.dataclass
class Stream:
    """One request: how to answer it, and what it has sent so far."""

    request_id: str
    include_stop_token: bool
    skip_special_tokens: bool
    detokenized: bool  # stop strings, n > 1: the engine's text is sent, not ids
    streamed: bool
    prefix: str  # the prompt, first in a non-streamed output
    send: Send
    fail: Fail
    is_cancelled: IsCancelled
    return_timing: bool = False
    extra: int = 0
    top_logprobs: int | None = None  # the log-probs asked for: the alternatives per token
    prompt_top: int = 0  # the alternatives per prompt token, when prompt log-probs are asked
    n: int = 1  # sequences per request (n > 1: detokenized here)
    beams: bool = False  # a beam search: every response holds every beam whole (`beams`)
    # ask Triton whether the client cancelled (False: the next step does, `codec`)
    polled: bool = True
    output_ids: list[int] = dataclasses.field(default_factory=list)
    counts: dict[int, int] = dataclasses.field(default_factory=dict)  # n > 1: tokens so far
    responses: int = 0
    last_sent: float = dataclasses.field(default_factory=time.monotonic)

    def responses_for(self, out: RequestOutput) -> list[Tensors]:
        """The engine responses for one engine output: one, or for n > 1 streamed (DELTA
        outputs hold the sequences that changed) one per sequence, tagged with its index."""
        if self.beams:
            self.counts = {}  # each output holds the beams whole
            return [self._sequences(out, out.outputs, -1)]
        if self.n == 1:
            return [self.tensors(out)]
        if len(out.outputs) == 1 or self.streamed:
            return [self._sequences(out, [c], c.index) for c in out.outputs]
        return [self._sequences(out, out.outputs, -1)]

    def _sequences(self, out: RequestOutput, seqs: list[CompletionOutput], index: int) -> Tensors:
        """n > 1: the sequences' texts (decoded by the engine) and tokens one after another;
        `sequence_lengths` says how many tokens each has."""
        texts = [self.prefix + c.text for c in seqs]
        self.prefix = "" if self.streamed else self.prefix
        entries = [e for c in seqs for e in c.logprobs or []]
        logprobs = [next(iter(d.values())).logprob for d in entries]
        extras = self._logprob_tensors(entries, None)
        totals = [c.cumulative_logprob for c in seqs if c.cumulative_logprob is not None]
        if totals:
            extras["cum_log_probs"] = np.array(totals, dtype=np.float32)
        if out.prompt_logprobs is not None:
            extras |= _prompt_tensors(out.prompt_token_ids, out.prompt_logprobs, self.prompt_top)
        extras["sequence_lengths"] = _ints([len(c.token_ids) for c in seqs])
        for c in seqs:
            self.counts[c.index] = self.counts.get(c.index, 0) + len(c.token_ids)
        strings = [s for c, t in zip(seqs, texts, strict=True) for s in (t, c.finish_reason or "")]
        new = [t for c in seqs for t in c.token_ids]
        meta = self._meta(out, 0, sum(self.counts[c.index] for c in seqs), index)
        return self._pack([], meta, strings, logprobs, new) | extras | _cached(out)

    def _meta(self, out: RequestOutput, window: int, count: int, sequence: int) -> list[int]:
        index, self.responses = self.responses, self.responses + 1
        timing = self._timing(out)
        meta = [window, out.finished, self.skip_special_tokens, len(out.prompt_token_ids)]
        return [*meta, count, index, *timing, 0, self.extra, sequence]

    def tensors(self, out: RequestOutput) -> Tensors:
        completion = out.outputs[0]
        new = list(completion.token_ids)  # DELTA: this step's; FINAL_ONLY: all
        before = self.output_ids[-CONTEXT:]
        self.output_ids += new
        finish = completion.finish_reason or ""
        if self.detokenized:
            text, ids, window = self.prefix + completion.text, [], []
        else:
            text, ids, window = self.prefix, new, before
            if finish == "stop" and not self.include_stop_token:
                ids = ids[:-1]  # the EOS / stop token's text is not shown (as vLLM)
        self.prefix = ""
        entries = completion.logprobs or []
        logprobs = [next(iter(d.values())).logprob for d in entries]  # the chosen token first
        extras = self._logprob_tensors(entries, completion.cumulative_logprob)
        if out.prompt_logprobs is not None:
            extras |= _prompt_tensors(out.prompt_token_ids, out.prompt_logprobs, self.prompt_top)
        meta = self._meta(out, len(window), len(self.output_ids), -1)
        return self._pack(window + ids, meta, [text, finish], logprobs, new) | extras | _cached(out)

    def _logprob_tensors(self, entries: SampleLogprobs, cumulative: float | None) -> Tensors:
        """The optional log-prob outputs: top alternatives, the chosen tokens' ranks and the
        cumulative log-prob (when log-probs were computed)."""
        out: Tensors = {}
        if cumulative is not None:
            out["cum_log_probs"] = np.array([cumulative], dtype=np.float32)
        if self.top_logprobs is None:
            return out
        out["output_ranks"] = _ints([next(iter(d.values())).rank for d in entries])
        if self.top_logprobs > 0:
            ids, values = _top(entries, self.top_logprobs)
            out["output_top_token_ids"], out["output_top_log_probs"] = ids, values
        return out

    def probe(self) -> Tensors:
        meta = [0, 0, self.skip_special_tokens, 0, len(self.output_ids), -1, -1, -1, 1, 0, -1]
        return self._pack([], meta, ["", ""], [], [])

    def _pack(
        self,
        ids: list[int],
        meta: list[int],
        strings: list[str],
        logprobs: list[float],
        new: list[int],
    ) -> Tensors:
        """`strings`: text, finish_reason (per sequence, n > 1); request_id goes third."""
        raw = [s.encode("utf-8") for s in (*strings[:2], self.request_id, *strings[2:])]
        return {
            "ids": _ints(ids),
            "meta": _ints(meta),
            "strings": np.array(raw, dtype=np.object_),
            "output_log_probs": np.array(logprobs, dtype=np.float32),
            "output_token_ids": _ints(new),
        }

    def _timing(self, out: RequestOutput) -> tuple[int, int]:
        """Microseconds from arrival to first scheduled and to the first token, or -1."""
        m = out.metrics
        if not (self.return_timing and out.finished and m is not None):
            return -1, -1

        def us(seconds: float | None) -> int:
            return -1 if seconds is None else min(int(seconds * 1e6), 2**31 - 1)

        return us(m.queue_time), us(m.time_to_first_token)
