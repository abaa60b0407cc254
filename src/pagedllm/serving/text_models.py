"""The ensemble's text steps without Triton: `tokenizer` (prompt text -> ids) and the stateless
`detokenizer` (the engine's window protocol -> text; see `engine_model`). Each takes a request's
tensors through `get(name)` and returns the response's tensors as numpy arrays."""

from __future__ import annotations

import numpy as np

from pagedllm.serving.codec import Getter, RequestError
from pagedllm.serving.engine_model import Tensors
from pagedllm.text.detokenizer import window_text
from pagedllm.text.tokenizer import Tokenizer

# detokenizer inputs passed through unchanged to the client
PASSTHROUGH = (
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
    "index",
    "output_log_probs",
    "output_token_ids",
)


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

    def handle(self, get: Getter) -> Tensors:
        ids = [int(i) for i in _required(get, "output_ids").reshape(-1)]
        window = [int(i) for i in _required(get, "window_ids").reshape(-1)]
        prefix = _scalar(get, "text")
        assert isinstance(prefix, bytes)
        text = prefix.decode("utf-8") + window_text(
            self.tokenizer,
            window,
            ids,
            skip_special_tokens=bool(_scalar(get, "skip_special_tokens")),
            final=bool(_scalar(get, "final")),
        )
        out = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
        for name in PASSTHROUGH:
            out[name] = _required(get, name)
        return out

    @staticmethod
    def request_id(get: Getter) -> str:
        value = _scalar(get, "request_id")
        return value.decode() if isinstance(value, bytes) else str(value)
