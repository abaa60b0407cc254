"""The ensemble's text steps without Triton: `tokenizer` (prompt text -> ids) and the stateless
`detokenizer` (the engine's window protocol -> text; see `engine_model`). Each takes a request's
tensors through `get(name)` and returns the response's tensors as numpy arrays."""

from __future__ import annotations

import numpy as np

from pagedllm.serving.codec import Getter, RequestError
from pagedllm.serving.engine_model import META, CancelPolls, Tensors
from pagedllm.text.detokenizer import window_text
from pagedllm.text.tokenizer import Tokenizer

# detokenizer inputs passed through unchanged to the client
PASSTHROUGH = ("output_log_probs", "output_token_ids")
# `meta` fields passed on to the client
META_OUTPUTS = ("num_input_tokens", "num_output_tokens", "index")


def _required(get: Getter, name: str) -> np.ndarray:
    array = get(name)
    if array is None:
        raise RequestError(f"{name} is required")
    return array


def _scalar(get: Getter, name: str) -> object:
    array = _required(get, name)
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


class TokenizerModel:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def handle(self, get: Getter) -> Tensors:
        raw = _scalar(get, "text_input")
        if not isinstance(raw, bytes):
            raise RequestError("text_input must be a BYTES (string) tensor")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(
                f"text_input is not valid UTF-8 ({e.reason} at byte {e.start})"
            ) from None
        # as the engine encodes a text prompt (special tokens added, e.g. a BOS)
        return {"input_ids": np.array(self.tokenizer.encode(text), dtype=np.int32)}


class DetokenizerModel:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cancel_polls = CancelPolls()

    def handle(self, get: Getter) -> tuple[Tensors, str | None]:
        """The response's tensors, and the engine's request id if it is time to ask whether
        this response's ensemble request was cancelled (`CancelPolls`), else None."""
        meta = dict(zip(META, (int(v) for v in _required(get, "meta").reshape(-1)), strict=True))
        ids = [int(i) for i in _required(get, "ids").reshape(-1)]
        text, finish_reason, request_id = self._strings(get)
        ask = self._cancel_polls.due(request_id, bool(meta["final"]))
        window = meta["window_len"]
        text += window_text(
            self.tokenizer,
            ids[:window],
            ids[window:],
            skip_special_tokens=bool(meta["skip_special_tokens"]),
            final=bool(meta["final"]),
        )
        out = {
            "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
            "finish_reason": np.array([finish_reason.encode("utf-8")], dtype=np.object_),
        }
        for name in META_OUTPUTS:
            out[name] = np.array([meta[name]], dtype=np.int32)
        if meta["queue_time_us"] >= 0:  # asked for, on the last response only
            for name in ("queue_time", "time_to_first_token"):
                ms = meta[f"{name}_us"] / 1000
                out[f"{name}_ms"] = np.array([ms], dtype=np.float32)
        for name in PASSTHROUGH:
            out[name] = _required(get, name)
        return out, request_id if ask else None

    @staticmethod
    def _strings(get: Getter) -> list[str]:
        """`text`, `finish_reason`, `request_id`."""
        return [s.decode("utf-8") for s in _required(get, "strings").reshape(-1)]
