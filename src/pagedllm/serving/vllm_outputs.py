"""vllm_backend's output set, for a request that sent any of its `return_*` flags
(`codec.Extra.VLLM`): `text_output` and exactly the outputs those flags ask for, with its
types and meanings (triton-inference-server/vllm_backend, docs/additional_outputs.md):

- `finish_reason`: "None" until the last response, then "stop" / "length" / "abort";
- `cumulative_logprob`: the sum of the output's log-probs so far;
- `logprobs`: JSON, this response's tokens: `[{"<id>": {"logprob", "rank",
  "decoded_token"}, ...}, ...]`, the chosen token first, then the top ones (vLLM's
  `SampleLogprobs`); `null` when no log-probs were asked for in `sampling_parameters`;
- `num_input_tokens`: the prompt's tokens; `num_output_tokens`: the tokens of *this* response
  (all of them when not streamed).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pagedllm.serving.codec import Extra
from pagedllm.text.tokenizer import Tokenizer

Tensors = dict[str, np.ndarray]


def vllm_outputs(
    tokenizer: Tokenizer, text: str, finish_reason: str, meta: dict[str, int], inputs: Tensors
) -> Tensors:
    """The response's tensors; `inputs`: the detokenizer's (checked) tensors from the engine."""
    extra = Extra(meta["extra"])
    out = {"text_output": _bytes(text)}
    if extra & Extra.FINISH_REASON:
        out["finish_reason"] = _bytes(finish_reason if meta["final"] else "None")
    if extra & Extra.CUMULATIVE_LOGPROB:
        total = inputs.get("cum_log_probs", np.zeros(1, dtype=np.float32))
        out["cumulative_logprob"] = total.astype(np.float32).reshape(1)
    if extra & Extra.LOGPROBS:
        out["logprobs"] = _bytes(json.dumps(_logprobs(tokenizer, inputs)))
    if extra & Extra.NUM_INPUT_TOKENS:
        out["num_input_tokens"] = np.array([meta["num_input_tokens"]], dtype=np.uint32)
    if extra & Extra.NUM_OUTPUT_TOKENS:
        new = len(inputs["output_token_ids"])
        out["num_output_tokens"] = np.array([new], dtype=np.uint32)
    return out


def _logprobs(tokenizer: Tokenizer, inputs: Tensors) -> list[dict[str, Any]] | None:
    if "output_ranks" not in inputs:  # none asked for
        return None

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


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)
