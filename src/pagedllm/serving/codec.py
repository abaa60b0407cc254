"""Request tensors (as numpy arrays, the way Triton's Python backend hands them over) to a
prompt and `SamplingParams`, with errors a client can act on.

The client contract (DESIGN.md): `text_input` (BYTES, required); optional TensorRT-LLM-style
scalars (`max_tokens`, `temperature`, ...); and `sampling_parameters`, one JSON object with
vLLM's names. Both may be sent: the JSON object is read first and scalar tensors override
its keys. Unknown JSON keys are rejected (naming them), so a misspelled parameter never
passes silently. Flags: `stream` (one response per step vs exactly one),
`exclude_input_in_output`, `return_log_probs` (the chosen tokens' log-probs), `return_timing`
(queue time and time to first token on the last response). Structured outputs: vLLM's
keys in the JSON object or TensorRT-LLM's `guided_decoding_guide_type` / `_guide` tensors
(`serving.structured`); the engine compiles the constraint. Inside the ensemble the
`tokenizer` model adds `input_ids` (the prompt's token ids); `text_input` then only supplies
the prompt text that a non-streamed output starts with; and `downstream_cancel_check` (the
`detokenizer` watches for the client's cancel, so `llm_engine` does not ask Triton too).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.beam_search import BeamSearchParams
from pagedllm.convert import to_bool
from pagedllm.sampling_params import SamplingParams
from pagedllm.serving import request_params, structured
from pagedllm.serving.beams import beam_params
from pagedllm.serving.errors import RequestError
from pagedllm.serving.inputs import Getter

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
    "top_logprobs": "logprobs",
    # TensorRT-LLM's names for the same settings
    "min_length": "min_tokens",
    "random_seed": "seed",
    "num_return_sequences": "n",
}
# TensorRT-LLM inputs with no SamplingParams field (see `_trtllm`)
TRTLLM_INPUTS = (
    "beam_width",
    "end_id",
    "pad_id",
    "length_penalty",
    "early_stopping",
    "return_context_logits",
    "return_generation_logits",
)
# the ensemble's mark (its `tokenizer` step sends it): see GenerateRequest
DOWNSTREAM_CANCEL_CHECK = "downstream_cancel_check"
FLAG_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_log_probs",
    "return_timing",
    "return_prompt_log_probs",
    DOWNSTREAM_CANCEL_CHECK,
)


class Extra(enum.IntFlag):
    """Which outputs a request's responses carry beyond pagedllm's own set (docs/serving.md,
    the contract table); sent to the detokenizer in `meta`."""

    NONE = 0
    VLLM = 1  # a vllm_backend flag was sent: text_output + exactly the outputs they ask for
    FINISH_REASON = 2
    CUMULATIVE_LOGPROB = 4
    LOGPROBS = 8  # vllm_backend's JSON log-probs
    NUM_INPUT_TOKENS = 16
    NUM_OUTPUT_TOKENS = 32


# vllm_backend's optional-output flags
VLLM_FLAGS = {
    "return_finish_reason": Extra.FINISH_REASON,
    "return_cumulative_logprob": Extra.CUMULATIVE_LOGPROB,
    "return_logprobs": Extra.LOGPROBS,
    "return_num_input_tokens": Extra.NUM_INPUT_TOKENS,
    "return_num_output_tokens": Extra.NUM_OUTPUT_TOKENS,
}
ALL_INPUTS = (
    "text_input",
    "input_ids",
    "sampling_parameters",
    "stop_words",
    "bad_words",
    *SCALAR_INPUTS,
    *TRTLLM_INPUTS,
    *FLAG_INPUTS,
    *VLLM_FLAGS,
    *structured.GUIDE_INPUTS,
)

# sequences per request (n, num_return_sequences)
MAX_N = 64
# beams per request (each asks for 2 x width log-probs: the engine's cap is 20)
MAX_BEAM_WIDTH = 10
# sampling_parameters longer than this are refused (its longest legitimate part: stop lists)
MAX_JSON_CHARS = 1 << 19  # room for a schema of the largest size allowed, escaped


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
    extra: Extra = Extra.NONE
    # the log-probs the client asked for (`params.logprobs` may be set for cumulative_logprob
    # alone): None, or the number of top alternatives per token
    top_logprobs: int | None = None
    # set by the ensemble (its `tokenizer` step): the step after `llm_engine` asks Triton
    # whether the client cancelled and reports it, so `llm_engine` need not ask too
    downstream_cancel_check: bool = False
    # beam_width > 1: a beam search (`serving.beams`), its settings from `params`
    beam: BeamSearchParams | None = None
    # vllm_backend's `lora_name` in sampling_parameters: the adapter (`serving.lora`)
    lora_name: Any = None


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


def parse_request(get: Getter, parameters: dict[str, Any] | None = None) -> GenerateRequest:
    """Read a request through `get(name)` (the input tensor as a numpy array, or None) and
    its Triton request `parameters` (`request_params`: vllm_backend's sampling parameters,
    under those of the `sampling_parameters` input and the input tensors)."""
    text, ids = get("text_input"), prompt_ids(get("input_ids"))
    if text is None and ids is None:
        raise RequestError("text_input is required")
    prompt = "" if text is None else _single("text_input", text)
    if not isinstance(prompt, str):
        raise RequestError("text_input must be a BYTES (string) tensor")
    values: dict[str, Any] = {}
    raw_json = get("sampling_parameters")
    if raw_json is not None:
        values.update(_json_object(str(_single("sampling_parameters", raw_json))))
    by_param = dict(parameters or {})
    request_params.check(by_param, request_params.generation_keys())
    own = {k: by_param.pop(k) for k in request_params.OWN if k in by_param}
    for key, value in by_param.items():
        values.setdefault(key, value)
    lora_name = values.pop("lora_name", own.get("lora_name"))
    sent: dict[str, str] = {}  # field -> the tensor that set it
    for name, field in SCALAR_INPUTS.items():
        array = get(name)
        if array is None:
            continue
        value = _single(name, array)
        if field in sent and values[field] != value:
            raise RequestError(
                f"{sent[field]} and {name} disagree ({values[field]!r} vs {value!r}): send one"
            )
        values[field], sent[field] = value, name
    for name, key in (("stop_words", "stop"), ("bad_words", "bad_words")):
        if (words := get(name)) is not None:
            values[key] = [_utf8(name, w) if isinstance(w, bytes) else str(w) for w in words.flat]
    flags = {
        name: _flag(name, _single(name, a))
        for name in (*FLAG_INPUTS, *VLLM_FLAGS)
        if (a := get(name)) is not None
    }
    for name in ("stream", "exclude_input_in_output"):
        if name in own and name not in flags:
            flags[name] = _flag(name, own[name])
    extra = Extra.NONE
    for name, bit in VLLM_FLAGS.items():
        if name in flags:
            extra |= Extra.VLLM | (bit if flags[name] else Extra.NONE)
    _structured(get, values)
    width, length_penalty, early_stopping = _trtllm(get, values)
    if flags.get("return_log_probs") and values.get("logprobs") is None:
        values["logprobs"] = 0  # the chosen token's log-prob
    top_logprobs = values.get("logprobs")
    if extra & Extra.CUMULATIVE_LOGPROB and top_logprobs is None:
        values["logprobs"] = 0  # computed for the sum; no log-probs are shown
    if flags.get("return_prompt_log_probs") and values.get("prompt_logprobs") is None:
        values["prompt_logprobs"] = top_logprobs or 0
    try:
        params = SamplingParams.from_dict(values)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e)) from None
    if params.n > MAX_N:
        raise RequestError(f"n must be at most {MAX_N}, got {params.n}")
    try:
        beam = None if width == 1 else beam_params(params, width, length_penalty, early_stopping)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return GenerateRequest(
        prompt=prompt,
        params=params,
        prompt_token_ids=ids,
        stream=flags.get("stream", False),
        exclude_input_in_output=flags.get("exclude_input_in_output", False),
        return_timing=flags.get("return_timing", False),
        extra=extra,
        top_logprobs=params.logprobs if top_logprobs is not None else None,
        downstream_cancel_check=flags.get(DOWNSTREAM_CANCEL_CHECK, False),
        beam=beam,
        lora_name=lora_name,
    )


def prompt_ids(ids: np.ndarray | None) -> list[int] | None:
    if ids is None:
        return None
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"input_ids must be integers, got {ids.dtype}")
    flat = [int(i) for i in ids.reshape(-1)]
    for k, i in enumerate(flat):
        if not 0 <= i < 2**31:
            raise RequestError(f"input_ids[{k}] = {i} is not a token id")
    return flat


def _structured(get: Getter, values: dict[str, Any]) -> None:
    """Structured outputs in vLLM's and TensorRT-LLM's spellings (`serving.structured`)."""
    guide_type, guide = (
        None if (a := get(name)) is None else str(_single(name, a))
        for name in structured.GUIDE_INPUTS
    )
    try:
        structured.resolve(values, guide_type, guide)
    except ValueError as e:
        raise RequestError(str(e)) from None


def _trtllm(get: Getter, values: dict[str, Any]) -> tuple[int, float, bool | str | None]:
    """TensorRT-LLM's inputs that have no SamplingParams field of their own; returns the
    beam width, length penalty and early stopping (None: not sent)."""

    def read(name: str) -> Any:
        array = get(name)
        return None if array is None else _single(name, array)

    beam_width = read("beam_width")
    beam_width = 1 if beam_width is None else beam_width
    if isinstance(beam_width, bool | float | str) or not 1 <= beam_width <= MAX_BEAM_WIDTH:
        raise RequestError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {beam_width!r}")
    for name in ("return_context_logits", "return_generation_logits"):
        if (flag := read(name)) is not None and _flag(name, flag):
            raise RequestError(
                f"{name} is not supported: ask for log-probs instead (return_log_probs,"
                " top_logprobs, return_prompt_log_probs)"
            )
    end_id, pad_id = read("end_id"), read("pad_id")
    for name, value in (("end_id", end_id), ("pad_id", pad_id)):
        if value is not None and (isinstance(value, bool | float | str) or value < -1):
            raise RequestError(f"{name} must be a token id or -1, got {value!r}")
    if end_id is not None and end_id >= 0:  # the one token that ends the output (-1: EOS)
        values["ignore_eos"] = True
        ids = values.get("stop_token_ids") or []
        values["stop_token_ids"] = [*(ids if isinstance(ids, list) else [ids]), end_id]
    length_penalty = read("length_penalty")  # scores beams only: nothing to do with one
    if length_penalty is not None and not np.isfinite(float(length_penalty)):
        raise RequestError(f"length_penalty must be a finite number, got {length_penalty!r}")
    # ends beams only: nothing to do with one. The tensor is TensorRT-LLM's (BOOL); the
    # sampling_parameters key is vLLM's former SamplingParams field (a bool, or "never")
    stop, tensor = values.pop("early_stopping", None), read("early_stopping")
    stop = stop if tensor is None else tensor
    early_stopping: bool | str | None = stop
    if stop is not None and stop != "never":
        early_stopping = _flag("early_stopping", stop)
    return int(beam_width), 1.0 if length_penalty is None else float(length_penalty), early_stopping
