"""The ensemble's text steps without Triton: `tokenizer` (prompt text -> ids) and the stateless
`detokenizer` (the engine's window protocol -> text; see `engine_model`). Each takes a request's
tensors through `get(name)` and returns the response's tensors as numpy arrays. Both models
can be called directly by any client of the server: every input is checked here, and a bad
one is a `RequestError` (INVALID_ARG), never a crash."""

from __future__ import annotations

import numpy as np

from pagedllm.serving.cancel_polls import CancelPolls
from pagedllm.serving.codec import Getter, RequestError
from pagedllm.serving.engine_model import META, Tensors
from pagedllm.serving.settings import DEFAULT_MAX_PROMPT_BYTES
from pagedllm.text.detokenizer import window_text
from pagedllm.text.tokenizer import Tokenizer

# detokenizer inputs passed through unchanged to the client, with their dtypes
PASSTHROUGH = {"output_log_probs": np.float32, "output_token_ids": np.int32}
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


def _ints(get: Getter, name: str) -> list[int]:
    array = _required(get, name)
    if array.dtype != np.int32:
        raise RequestError(f"{name} must be INT32, got {array.dtype}")
    return [int(v) for v in array.reshape(-1)]


class TokenizerModel:
    def __init__(self, tokenizer: Tokenizer, max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES):
        self.tokenizer = tokenizer
        self.max_prompt_bytes = max_prompt_bytes

    def handle(self, get: Getter) -> Tensors:
        raw = _scalar(get, "text_input")
        if not isinstance(raw, bytes):
            raise RequestError("text_input must be a BYTES (string) tensor")
        if len(raw) > self.max_prompt_bytes:
            raise RequestError(
                f"text_input is too large: {len(raw)} bytes, the limit is"
                f" {self.max_prompt_bytes} (max_prompt_bytes)"
            )
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

    def handle(self, get: Getter) -> tuple[Tensors | None, str | None]:
        """The response's tensors (None for a probe: nothing to answer), and the engine's
        request id if it is time to ask whether this response's ensemble request was
        cancelled (always for a probe; else at most once per `CancelPolls` interval)."""
        values = _ints(get, "meta")
        if len(values) != len(META):
            raise RequestError(f"meta must hold {len(META)} values, got {len(values)}")
        meta = dict(zip(META, values, strict=True))
        text, finish_reason, request_id = self._strings(get)
        if meta["probe"]:
            return None, request_id
        ids = _ints(get, "ids")
        window = meta["window_len"]
        if not 0 <= window <= len(ids):
            raise RequestError(f"meta window_len must be in [0, {len(ids)}], got {window}")
        if any(i < 0 for i in ids):  # (ids past the tokenizer's vocabulary decode to "")
            raise RequestError("ids must be token ids (>= 0)")
        ask = self._cancel_polls.due(request_id, bool(meta["final"]))
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
        for name, dtype in PASSTHROUGH.items():
            array = _required(get, name)
            if array.dtype != dtype or array.ndim != 1:
                raise RequestError(f"{name} must be a 1-D {np.dtype(dtype).name} tensor")
            out[name] = array
        return out, request_id if ask else None

    @staticmethod
    def _strings(get: Getter) -> list[str]:
        """`text`, `finish_reason`, `request_id`."""
        array = _required(get, "strings").reshape(-1)
        if array.size != 3 or not all(isinstance(s, bytes) for s in array):
            raise RequestError("strings must hold 3 BYTES values")
        try:
            return [s.decode("utf-8") for s in array]
        except UnicodeDecodeError:
            raise RequestError("strings must be valid UTF-8") from None
