"""Request tensors (as numpy arrays, the way Triton's Python backend hands them over) to a
prompt and `SamplingParams`, with errors a client can act on.

The client contract (DESIGN.md): `text_input` (BYTES, required); optional TensorRT-LLM-style
scalars (`max_tokens`, `temperature`, ...); and `sampling_parameters`, one JSON object with
vLLM's names. Both may be sent: the JSON object is read first and scalar tensors override
its keys. Unknown JSON keys are rejected (naming them), so a misspelled parameter never
passes silently. Flags: `stream` (one response per step vs exactly one),
`exclude_input_in_output`, `return_log_probs` (the chosen tokens' log-probs), `return_timing`
(queue time and time to first token on the last response). Inside the
ensemble the `tokenizer` model adds `input_ids` (the prompt's token ids); `text_input` then only
supplies the prompt text that a non-streamed output starts with.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.sampling_params import SamplingParams, to_bool

# scalar input tensor -> SamplingParams field
SCALAR_INPUTS = {
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_log_probs", "return_timing")
ALL_INPUTS = (
    "text_input",
    "input_ids",
    "sampling_parameters",
    "stop_words",
    *SCALAR_INPUTS,
    *FLAG_INPUTS,
)

Getter = Callable[[str], "np.ndarray | None"]
# sampling_parameters longer than this are refused (its longest legitimate part: stop lists)
MAX_JSON_CHARS = 1 << 18


class RequestError(ValueError):
    """A request that cannot be served; the message is for the client."""


@dataclass
class GenerateRequest:
    prompt: str
    params: SamplingParams
    prompt_token_ids: list[int] | None = None
    stream: bool = False
    # as Triton's vLLM and TensorRT-LLM backends: a non-streamed text_output starts with the
    # prompt unless the client sets exclude_input_in_output; streamed outputs never do
    exclude_input_in_output: bool = False
    # the last response carries queue_time_ms and time_to_first_token_ms
    return_timing: bool = False


def _single(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        return _utf8(name, value)
    return value.item() if isinstance(value, np.generic) else value


def _utf8(name: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _json_object(text: str) -> dict[str, Any]:
    if len(text) > MAX_JSON_CHARS:
        raise RequestError(
            f"sampling_parameters is too large: {len(text)} characters, the limit is"
            f" {MAX_JSON_CHARS}"
        )
    try:
        obj = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError(f"sampling_parameters is not valid JSON: {e}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise RequestError("sampling_parameters is nested too deeply") from None
    if not isinstance(obj, dict):
        raise RequestError("sampling_parameters must be a JSON object")
    return obj


def _flag(name: str, value: Any) -> bool:
    try:
        return to_bool(name, value)
    except ValueError as e:
        raise RequestError(str(e)) from None


def parse_request(get: Getter) -> GenerateRequest:
    """Read a request through `get(name)` (the input tensor as a numpy array, or None)."""
    text = get("text_input")
    if text is None:
        raise RequestError("text_input is required")
    prompt = _single("text_input", text)
    if not isinstance(prompt, str):
        raise RequestError("text_input must be a BYTES (string) tensor")
    values: dict[str, Any] = {}
    raw_json = get("sampling_parameters")
    if raw_json is not None:
        values.update(_json_object(str(_single("sampling_parameters", raw_json))))
    for name, field in SCALAR_INPUTS.items():
        array = get(name)
        if array is not None:
            values[field] = _single(name, array)
    stop_words = get("stop_words")
    if stop_words is not None:
        values["stop"] = [
            _utf8("stop_words", w) if isinstance(w, bytes) else str(w)
            for w in stop_words.reshape(-1)
        ]
    flags = {
        name: _flag(name, _single(name, a)) for name in FLAG_INPUTS if (a := get(name)) is not None
    }
    if flags.get("return_log_probs") and "logprobs" not in values:
        values["logprobs"] = 0  # the chosen token's log-prob
    try:
        params = SamplingParams.from_dict(values)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e)) from None
    if params.n != 1:
        raise RequestError(f"n must be 1 here (one stream per request), got {params.n}")
    ids = get("input_ids")
    if ids is not None and not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"input_ids must be integers, got {ids.dtype}")
    return GenerateRequest(
        prompt=prompt,
        params=params,
        prompt_token_ids=None if ids is None else [int(i) for i in ids.reshape(-1)],
        stream=flags.get("stream", False),
        exclude_input_in_output=flags.get("exclude_input_in_output", False),
        return_timing=flags.get("return_timing", False),
    )
