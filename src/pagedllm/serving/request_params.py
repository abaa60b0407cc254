"""Triton request parameters (`request.parameters()`: a JSON object of bool, int, float and
string values) and which of them a model accepts (docs/contract.md, "Request parameters").

What reaches a Python model, checked on tritonserver 2.51: the `parameters` object of an HTTP
`generate` / `infer` body or of a gRPC request, and every top-level field of a `generate`
body that names no input (a misspelled input arrives here); an ensemble hands them to every
step. Triton's own keys (`priority`, `timeout`, `sequence_*`, `binary_data_output`,
`triton_enable_empty_final_response`) never do, and neither do HTTP headers; gRPC headers do
only under `--grpc-header-forward-pattern`.

The `ensemble`, `llm_engine` and `llm` models read them as vllm_backend does: a request's
parameters are its sampling parameters (vLLM's keys, `"parameters": {"temperature": 0,
"max_tokens": 45}` as vllm_backend's README sends them) plus `lora_name`, `stream` and
`exclude_input_in_output`; a key also in the `sampling_parameters` input, or an input of its
own, is the input's. Any other key is refused (INVALID_ARG naming it), never ignored.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from typing import Any

import numpy as np

from pagedllm.convert import to_bool
from pagedllm.sampling_params import SamplingParams
from pagedllm.serving import structured
from pagedllm.serving.errors import RequestError
from pagedllm.serving.inputs import Getter

# the keys that are not sampling parameters, and what they mean
OWN = {
    "lora_name": "the LoRA adapter (docs/lora.md)",
    "stream": "the stream input",
    "exclude_input_in_output": "the exclude_input_in_output input",
}


def sampling_keys() -> frozenset[str]:
    """The keys `sampling_parameters` accepts (codec.parse_request)."""
    fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init} - {"output_kind"}
    return frozenset(
        {*fields, *structured.OBJECTS, *structured.FLAT, *structured.FLAT_OPTIONS, "early_stopping"}
    )


def parse(text: str) -> dict[str, Any]:
    """A request's parameters, from the JSON text Triton's Python backend gives."""
    try:
        obj = json.loads(text) if text and text.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError(f"the request's parameters are not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError("the request's parameters must be a JSON object")
    return obj


def check(params: dict[str, Any], accepted: Collection[str], model: str = "") -> None:
    """Refuse any key of `params` not in `accepted`, naming it and the accepted ones
    (`model`: who refuses, when none is accepted)."""
    unknown = sorted(set(params) - set(accepted))
    if not unknown:
        return
    names = ", ".join(map(repr, unknown))
    what = "request parameters" if len(unknown) > 1 else "request parameter"
    if not accepted:
        raise RequestError(
            f"unknown {what} {names}: {model} takes no request parameters (send inputs)"
        )
    raise RequestError(f"unknown {what} {names}; the accepted ones: {', '.join(sorted(accepted))}")


def generation_keys() -> frozenset[str]:
    """What `ensemble`, `llm_engine` and `llm` accept: vllm_backend's set."""
    return sampling_keys() | frozenset(OWN)


def as_inputs(params: dict[str, Any], get: Getter) -> dict[str, np.ndarray]:
    """For a model that calls `llm_engine` by BLS (`llm`): request parameters do not travel
    with the inner request (its parameters take no float), so `params` are checked here and
    become inputs — the sampling keys and `lora_name` join `sampling_parameters` (whose own
    keys win), `exclude_input_in_output` its input when not sent. Returns the inputs to
    replace; `stream` is the caller's (`llm` answers once)."""
    check(params, generation_keys())
    out: dict[str, np.ndarray] = {}
    rest = {k: v for k, v in params.items() if k not in ("stream", "exclude_input_in_output")}
    raw = get("sampling_parameters")
    if rest:
        try:
            sent = json.loads(raw.reshape(-1)[0]) if raw is not None and raw.size == 1 else {}
        except (ValueError, UnicodeDecodeError):
            sent = None  # llm_engine names what is wrong with it
        if isinstance(sent, dict):
            merged = json.dumps({**rest, **sent}).encode()
            out["sampling_parameters"] = np.array([merged], dtype=np.object_)
    if "exclude_input_in_output" in params and get("exclude_input_in_output") is None:
        try:
            flag = to_bool("exclude_input_in_output", params["exclude_input_in_output"])
        except ValueError as e:
            raise RequestError(str(e)) from None
        out["exclude_input_in_output"] = np.array([flag])
    return out
