"""vllm_backend's output set, for a request that sent any of its `return_*` flags
(`codec.Extra.VLLM`): `text_output` and exactly the outputs those flags ask for, with its
types and meanings (triton-inference-server/vllm_backend, docs/additional_outputs.md):

- `finish_reason`: "None" until the sequence ends, then "stop" / "length" / "abort";
- `cumulative_logprob`: the sum of the output's log-probs so far;
- `logprobs`: JSON, this response's tokens: `[{"<id>": {"logprob", "rank",
  "decoded_token"}, ...}, ...]`, the chosen token first, then the top ones (vLLM's
  `SampleLogprobs`); `null` when no log-probs were asked for in `sampling_parameters`;
- `num_input_tokens`: the prompt's tokens; `num_output_tokens`: the tokens of *this* response
  (all of them when not streamed).

With n > 1, a non-streamed response holds one element per sequence; streamed, each response is
about one sequence (`sequence_index`, pagedllm's addition: vllm_backend's own layout is by
position only).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np

from pagedllm.serving.codec import Extra
from pagedllm.text.tokenizer import Tokenizer

Tensors = dict[str, np.ndarray]


def vllm_outputs(
    tokenizer: Tokenizer,
    texts: list[str],
    finishes: list[str],
    meta: dict[str, int],
    inputs: Tensors,
) -> Tensors:
    """The response's tensors, one element per sequence; `inputs`: the detokenizer's (checked)
    tensors from the engine (several sequences' tokens one after another)."""
    extra = Extra(meta["extra"])
    lengths = inputs.get("sequence_lengths", np.array([len(inputs["output_token_ids"])]))
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    out = {"text_output": _bytes(texts)}
    if extra & Extra.FINISH_REASON:
        out["finish_reason"] = _bytes([f or "None" for f in finishes])
    if extra & Extra.CUMULATIVE_LOGPROB:
        total = inputs.get("cum_log_probs", np.zeros(len(texts), dtype=np.float32))
        out["cumulative_logprob"] = total.astype(np.float32)
    if extra & Extra.LOGPROBS:
        per_sequence = [
            json.dumps(_logprobs(tokenizer, inputs, start, end))
            for start, end in itertools.pairwise(starts)
        ]
        out["logprobs"] = _bytes(per_sequence)
    if extra & Extra.NUM_INPUT_TOKENS:
        out["num_input_tokens"] = np.array([meta["num_input_tokens"]], dtype=np.uint32)
    if extra & Extra.NUM_OUTPUT_TOKENS:
        out["num_output_tokens"] = np.asarray(lengths, dtype=np.uint32)
    return out


def _logprobs(
    tokenizer: Tokenizer, inputs: Tensors, start: int, end: int
) -> list[dict[str, Any]] | None:
    """Tokens start..end of this response (one sequence's)."""
    if "output_ranks" not in inputs:  # none asked for
        return None
    inputs = {name: a[start:end] for name, a in inputs.items() if name.startswith("output_")}

    def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
        text = tokenizer.decode([token], False)
        return {"logprob": float(logprob), "rank": rank, "decoded_token": text}

    chosen = zip(
        inputs["output_token_ids"], inputs["output_log_probs"], inputs["output_ranks"], strict=True
    )
    top_ids = inputs.get("output_top_token_ids")
    top_values = inputs.get("output_top_log_probs")
    out = []
    for row, (token, logprob, rank) in enumerate(chosen):
        d = {str(int(token)): entry(int(token), logprob, int(rank))}
        if top_ids is not None and top_values is not None:
            for r, (tid, value) in enumerate(
                zip(top_ids[row], top_values[row], strict=True), start=1
            ):
                d.setdefault(str(int(tid)), entry(int(tid), value, r))
        out.append(d)
    return out


def _bytes(texts: list[str]) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
