"""The ensemble's text steps without Triton: `tokenizer` (prompt text -> ids) and the stateless
`detokenizer` (the engine's window protocol -> text; see `engine_model`). Each takes a request's
tensors through `get(name)` and returns the response's tensors as numpy arrays. Both models
can be called directly by any client of the server: every input is checked here, and a bad
one is a `RequestError` (INVALID_ARG), never a crash."""

from __future__ import annotations

import numpy as np

from pagedllm.serving.cancel_polls import CancelPolls
from pagedllm.serving.codec import (
    DOWNSTREAM_CANCEL_CHECK,
    Extra,
    RequestError,
    prompt_ids,
)
from pagedllm.serving.engine_stream import META, Tensors
from pagedllm.serving.inputs import Getter
from pagedllm.serving.settings import DEFAULT_MAX_PROMPT_BYTES
from pagedllm.serving.vllm_outputs import vllm_outputs
from pagedllm.text.detokenizer import window_text
from pagedllm.text.tokenizer import Tokenizer

# detokenizer inputs passed through unchanged to the client, with their dtypes and ranks
PASSTHROUGH = {"output_log_probs": (np.float32, 1), "output_token_ids": (np.int32, 1)}
# ... and those the engine sends only when they were asked for
OPTIONAL = {
    "output_top_token_ids": (np.int32, 2),
    "output_top_log_probs": (np.float32, 2),
    "output_ranks": (np.int32, 1),
    "cum_log_probs": (np.float32, 1),
    "prompt_token_ids": (np.int32, 1),
    "prompt_log_probs": (np.float32, 1),
    "prompt_top_token_ids": (np.int32, 2),
    "prompt_top_log_probs": (np.float32, 2),
    "prompt_ranks": (np.int32, 1),
    "sequence_lengths": (np.int32, 1),
    "num_cached_tokens": (np.uint32, 1),
}
# optional inputs with one row per output token
TOKEN_ROWS = ("output_ranks", "output_top_token_ids", "output_top_log_probs")
# token ids whose texts the detokenizer adds, as `<name>s` -> `<texts name>`
TOKEN_TEXTS = {
    "output_top_token_ids": "output_top_tokens",
    "prompt_token_ids": "prompt_tokens",
    "prompt_top_token_ids": "prompt_top_tokens",
}


def _required(get: Getter, name: str) -> np.ndarray:
    array = get(name)
    if array is None:
        raise RequestError(f"{name} is required")
    return array


def _tensor(
    get: Getter, name: str, dtype: type, ndim: int, required: bool = False
) -> np.ndarray | None:
    array = _required(get, name) if required else get(name)
    if array is not None and (array.dtype != dtype or array.ndim != ndim):
        raise RequestError(f"{name} must be a {ndim}-D {np.dtype(dtype).name} tensor")
    return array


def _check_rows(inputs: Tensors, sequences: int) -> None:
    """The log-prob tensors have one row per token, and several sequences say how many tokens
    each has: a direct caller's must, too."""
    rows = len(inputs["output_token_ids"])
    lengths = inputs.get("sequence_lengths")
    if sequences > 1 and (lengths is None or len(lengths) != sequences or sum(lengths) != rows):
        raise RequestError(f"sequence_lengths must hold {sequences} lengths adding up to {rows}")
    if "output_ranks" in inputs:
        sized = [n for n in ("output_log_probs", *TOKEN_ROWS) if n in inputs]
    else:
        sized = [n for n in TOKEN_ROWS if n in inputs]
    for name in sized:
        if len(inputs[name]) != rows:
            raise RequestError(f"{name} must have one row per output token ({rows})")
    ranks, scored = inputs.get("prompt_ranks"), inputs.get("prompt_log_probs")
    if ranks is not None and (scored is None or len(ranks) != len(scored)):
        raise RequestError("prompt_ranks must have one value per prompt log-prob")
    for which in ("output", "prompt"):
        ids, values = (inputs.get(f"{which}_top_{n}") for n in ("token_ids", "log_probs"))
        if ids is not None and values is not None and ids.shape != values.shape:
            raise RequestError(f"{which}_top_token_ids and {which}_top_log_probs differ in shape")


def _bytes(texts: list[str]) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)


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


def _for_engine(ids: np.ndarray) -> Tensors:
    """The tokenizer's outputs: the prompt's ids, and `downstream_cancel_check` — in the
    ensemble, the `detokenizer` after `llm_engine` asks Triton whether the client cancelled
    (DESIGN.md fact 5): `llm_engine` need not ask too, which saves a round trip from its stub
    to the server per response."""
    return {"input_ids": ids, DOWNSTREAM_CANCEL_CHECK: np.array([True])}


class TokenizerModel:
    def __init__(self, tokenizer: Tokenizer, max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES):
        self.tokenizer = tokenizer
        self.max_prompt_bytes = max_prompt_bytes

    def handle(self, get: Getter) -> Tensors:
        ids = get("input_ids")
        if ids is not None:  # the prompt as token ids: checked here, not tokenized
            return _for_engine(np.array(prompt_ids(ids), dtype=np.int32))
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
        return _for_engine(np.array(self.tokenizer.encode(text), dtype=np.int32))


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
        texts, finishes, request_id = self._strings(get)
        if meta["probe"]:
            return None, request_id
        ids = _ints(get, "ids")
        window = meta["window_len"]
        if not 0 <= window <= len(ids):
            raise RequestError(f"meta window_len must be in [0, {len(ids)}], got {window}")
        if any(i < 0 for i in ids):  # (ids past the tokenizer's vocabulary decode to "")
            raise RequestError("ids must be token ids (>= 0)")
        ask = self._cancel_polls.due(request_id, bool(meta["final"]))
        texts[0] += window_text(
            self.tokenizer,
            ids[:window],
            ids[window:],
            skip_special_tokens=bool(meta["skip_special_tokens"]),
            final=bool(meta["final"]),
        )
        inputs: Tensors = {}
        for name, spec in (PASSTHROUGH | OPTIONAL).items():
            array = _tensor(get, name, *spec, required=name in PASSTHROUGH)
            if array is not None:
                inputs[name] = array
        _check_rows(inputs, len(texts))
        if meta["extra"] & Extra.VLLM:
            out = vllm_outputs(self.tokenizer, texts, finishes, meta, inputs)
        else:
            out = self._outputs(texts, finishes, meta, inputs)
        if meta["sequence_index"] >= 0:  # n > 1, streamed: which sequence this is about
            out["sequence_index"] = np.array([meta["sequence_index"]], dtype=np.int32)
        return out, request_id if ask else None

    def _outputs(
        self, texts: list[str], finishes: list[str], meta: dict[str, int], inputs: Tensors
    ) -> Tensors:
        """pagedllm's own output set, with the optional outputs the engine sent."""
        counts = [meta["num_output_tokens"]]
        if len(texts) > 1:  # n > 1, not streamed: one element per sequence
            counts = inputs["sequence_lengths"].tolist()
        out = {
            "text_output": _bytes(texts),
            "finish_reason": _bytes(finishes),
            "num_input_tokens": np.array([meta["num_input_tokens"]], dtype=np.uint32),
            "num_output_tokens": np.array(counts, dtype=np.uint32),
            "index": np.array([meta["index"]], dtype=np.int32),
        }
        if meta["queue_time_us"] >= 0:  # asked for, on the last response only
            for name in ("queue_time", "time_to_first_token"):
                ms = meta[f"{name}_us"] / 1000
                out[f"{name}_ms"] = np.array([ms], dtype=np.float32)
        out |= {name: a for name, a in inputs.items() if name != "output_ranks"}
        if "output_ranks" in inputs:  # log-probs were asked for: the chosen tokens' texts
            out["output_tokens"] = self._texts(inputs["output_token_ids"])
        for name, texts_name in TOKEN_TEXTS.items():
            if name in inputs:
                out[texts_name] = self._texts(inputs[name])
        return out

    def _texts(self, ids: np.ndarray) -> np.ndarray:
        texts = [self.tokenizer.decode([int(i)], False) for i in ids.flat]
        return _bytes(texts).reshape(ids.shape)

    @staticmethod
    def _strings(get: Getter) -> tuple[list[str], list[str], str]:
        """The texts and finish reasons (one per sequence), and the `request_id`: `text`,
        `finish_reason`, `request_id`, then a `text`, `finish_reason` pair per further
        sequence."""
        array = _required(get, "strings").reshape(-1)
        if array.size < 3 or array.size % 2 == 0 or not all(isinstance(s, bytes) for s in array):
            raise RequestError("strings must hold 3, 5, 7, ... BYTES values")
        try:
            values = [s.decode("utf-8") for s in array]
        except UnicodeDecodeError:
            raise RequestError("strings must be valid UTF-8") from None
        pairs = values[:2] + values[3:]
        return pairs[0::2], pairs[1::2], values[2]
