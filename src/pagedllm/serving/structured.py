"""Structured outputs as each client family spells them -> one `StructuredOutputsParams`
(vLLM's names, `pagedllm.structured.params`).

In `sampling_parameters` (vLLM's clients): `structured_outputs`, an object or its JSON text
(vllm_backend reads it with `json.loads`, so its clients send text); the older
`guided_decoding` (vLLM's GuidedDecodingParams: the same names); and the flat keys of vLLM's
OpenAI server, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
`guided_json_object`, with the options `guided_whitespace_pattern` and
`guided_decoding_backend`. As tensors (TensorRT-LLM's clients): `guided_decoding_guide_type`
(`json`, `json_schema`, `regex`, `ebnf_grammar`, `structural_tag`) with
`guided_decoding_guide`. A request asks for at most one constraint: two spellings at once, or
two flat keys, are refused naming them. Errors are ValueErrors whose message is for the
client; a schema, regex or grammar is compiled (and refused) by the engine.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pagedllm.convert import to_bool
from pagedllm.structured.params import StructuredOutputsParams

# objects in sampling_parameters (their JSON text is accepted too)
OBJECTS = ("structured_outputs", "guided_decoding")
# vLLM's OpenAI-server keys -> StructuredOutputsParams fields: constraints, then options
FLAT = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_json_object": "json_object",
}
FLAT_OPTIONS = {
    "guided_whitespace_pattern": "whitespace_pattern",
    "guided_decoding_backend": "backend",
}
# TensorRT-LLM's input tensors
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")
# TensorRT-LLM's guide types -> fields. `json` takes no guide: any JSON object, as its
# llguidance backend compiles it (its xgrammar backend also allows a top-level array)
GUIDE_TYPES = {
    "json": "json_object",
    "json_schema": "json",
    "regex": "regex",
    "ebnf_grammar": "grammar",
    "structural_tag": "structural_tag",
}
# vLLM's internal GuidedDecodingParams fields, present when a client serializes the dataclass
IGNORED = ("backend_was_auto", "_backend", "_backend_was_auto")
# options vLLM (0.8-0.9) read from the backend name, as in "xgrammar:disable-any-whitespace"
BACKEND_OPTIONS = {
    "disable-any-whitespace": "disable_any_whitespace",
    "no-additional-properties": "disable_additional_properties",
    "no-fallback": "disable_fallback",
}


def resolve(
    values: dict[str, Any], guide_type: str | None = None, guide: str | None = None
) -> None:
    """Replace every spelling in `values` (sampling_parameters, parsed) by one
    `structured_outputs` (a `StructuredOutputsParams`), or by nothing when none asks for a
    constraint. `guide_type` / `guide`: TensorRT-LLM's tensors' text, None when not sent."""
    sources: dict[str, dict[str, Any]] = {}
    for key in OBJECTS:
        if (obj := _object(key, values.pop(key, None))) is not None:
            sources[key] = obj
    flat = {FLAT[k]: v for k in FLAT if _given(FLAT[k], v := values.pop(k, None))}
    if len(flat) > 1:
        names = ", ".join(k for k, f in FLAT.items() if f in flat)
        raise ValueError(f"{names}: send one structured-output constraint, not {len(flat)}")
    if flat:
        sources[next(k for k, f in FLAT.items() if f in flat)] = flat
    options = {FLAT_OPTIONS[k]: v for k in FLAT_OPTIONS if (v := values.pop(k, None)) is not None}
    if (tensor := from_guide(guide_type, guide)) is not None:
        sources[GUIDE_INPUTS[0]] = tensor
    if len(sources) > 1:
        raise ValueError(
            f"{' and '.join(sources)} each ask for structured outputs: send one of them"
        )
    if not sources:  # options alone constrain nothing (vLLM ignores them too)
        return
    ((source, spec),) = sources.items()
    for field, value in options.items():
        if spec.get(field, value) != value:
            flat_name = next(k for k, f in FLAT_OPTIONS.items() if f == field)
            raise ValueError(
                f"{flat_name} and {source}.{field} disagree ({value!r} vs {spec[field]!r})"
            )
        spec[field] = value
    try:
        values["structured_outputs"] = _params(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from None


def from_guide(guide_type: str | None, guide: str | None) -> dict[str, Any] | None:
    """TensorRT-LLM's `guided_decoding_guide_type` + `guided_decoding_guide` as
    structured_outputs fields; None when neither asks for anything (an empty type and guide,
    as TensorRT-LLM reads them)."""
    types = ", ".join(GUIDE_TYPES)
    if not guide_type:
        if guide:
            raise ValueError(f"guided_decoding_guide needs guided_decoding_guide_type ({types})")
        return None
    field = GUIDE_TYPES.get(guide_type)
    if field is None:
        raise ValueError(f"guided_decoding_guide_type must be one of {types}, got {guide_type!r}")
    if field == "json_object":
        if guide:
            raise ValueError(
                "guided_decoding_guide_type json takes no guide (it allows any JSON object):"
                " send json_schema with a schema"
            )
        return {"json_object": True}
    if not guide:
        raise ValueError(f"guided_decoding_guide_type {guide_type} needs guided_decoding_guide")
    return {field: guide}


def check(spec: StructuredOutputsParams) -> None:
    """Refuse a schema, regex or grammar that does not compile, without a tokenizer (what
    the engine refuses when the request reaches it; for callers that must refuse before
    any other request runs). Raises ValueError as the engine does: "invalid <kind>
    constraint: ..."."""
    from pagedllm.structured.grammar import validate

    validate(spec)


def _object(key: str, value: Any) -> dict[str, Any] | None:
    """An object of sampling_parameters, or its JSON text; None or "" when not sent."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{key} is not valid JSON: {e}") from None
        except RecursionError:  # the parser recurses once per level of nesting
            raise ValueError(f"{key} is nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object (or its JSON text), got {value!r}")
    names = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    unknown = sorted(set(value) - names - set(IGNORED))
    if unknown:
        raise ValueError(f"unknown {key} keys: {', '.join(unknown)}")
    return {k: v for k, v in value.items() if v is not None and k not in IGNORED}


def _given(field: str, value: Any) -> bool:
    if field == "json_object":
        return value is not None and to_bool("guided_json_object", value)
    return value is not None


def _params(spec: dict[str, Any]) -> StructuredOutputsParams:
    spec = dict(spec)  # string flags are read by StructuredOutputsParams
    backend = spec.get("backend")
    if isinstance(backend, str) and ":" in backend:
        spec["backend"], _, listed = backend.partition(":")
        for option in filter(None, (o.strip() for o in listed.split(","))):
            if option not in BACKEND_OPTIONS:
                known = ", ".join(BACKEND_OPTIONS)
                raise ValueError(f"backend option {option!r} is not one of {known}")
            spec[BACKEND_OPTIONS[option]] = True
    return StructuredOutputsParams.from_dict(spec)
