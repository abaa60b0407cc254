"""Structured outputs in OpenAI's and vLLM's request fields, turned into the engine's
`structured_outputs` (vLLM's `StructuredOutputsParams` names, `pagedllm.structured.params`).

A request may constrain its output with OpenAI's `response_format` (`text`, `json_object`,
`json_schema`, and vLLM's `structural_tag`), vLLM's `structured_outputs` object, or vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` keys; at most one constraint
per request (several answer 400 naming them). The options (`disable_any_whitespace`,
`disable_additional_properties`, `whitespace_pattern`, or `guided_whitespace_pattern`) may come
in `structured_outputs` beside any of them. The shape is checked here; a schema, regex or
grammar the engine cannot compile is refused by the engine before it generates, and the gateway
answers 400 naming the field that carried it.

NOTE: a JSON schema's objects that do not say `additionalProperties` get none (the engine's
`disable_additional_properties`, on unless the request sets it false; `closed_objects` for the
tools' schemas): what vLLM's default backend (xgrammar, strict mode) does and what clients of
OpenAI's `strict: true` rely on, rather than JSON Schema's default (docs/structured_outputs.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from pagedllm.openai.errors import bad_request, parsed_json
from pagedllm.structured.params import FLAGS, KINDS, StructuredOutputsParams

# vLLM's older keys for each kind of constraint
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# accepted for vLLM's clients and changing nothing: there is one grammar engine, no fallback
IGNORED_OPTIONS = ("backend", "disable_fallback")


@dataclass(frozen=True)
class Constraint:
    """The engine's `structured_outputs` for a request, and the request field that set it (the
    `param` of a 400 when the engine refuses it)."""

    spec: dict[str, Any]
    param: str


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with `additionalProperties: false` on every object schema that does not say,
    as the engine reads a schema under `disable_additional_properties`."""
    from pagedllm.structured.grammar import _no_additional_properties  # the engine's own rule

    return _no_additional_properties(schema)


def checked_constraint(spec: dict[str, Any], param: str) -> Constraint:
    """`spec` checked as the engine checks it (its keys, its kind, its size), before the
    request is sent; 400 naming `param`, the field that carried it."""
    try:
        StructuredOutputsParams.from_dict(spec)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{param}: {e}", param) from None
    return Constraint(spec, param)


class Strict(BaseModel):
    """A request object: an unknown key, NaN or infinity is a 400."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(Strict):
    name: str
    description: str | None = None
    # `schema` would shadow BaseModel.schema: the field has another name, its alias the key
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tag: {"type": "structural_tag", "structures": [...], "triggers": [...]}
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def spec(self) -> dict[str, Any] | None:
        """The constraint's kind and value; None for plain text."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None:
                message = "response_format.json_schema is required when type is json_schema"
                raise bad_request(message, "response_format.json_schema")
            schema = self.json_schema.json_schema
            return {"json": schema} if schema is not None else {"json_object": True}
        if self.type == "structural_tag":
            if not self.structures or not self.triggers:
                message = "a structural_tag response_format needs structures and triggers"
                raise bad_request(message, "response_format")
            tag = {"type": "structural_tag", "structures": self.structures}
            return {"structural_tag": {**tag, "triggers": self.triggers}}
        return None


class StructuredRequest(Strict):
    """The structured-output fields both endpoints accept (vLLM's, besides OpenAI's)."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted, changes nothing
    _constraint: Constraint | None = PrivateAttr(default=None)

    @property
    def constraint(self) -> Constraint | None:
        """The request's constraint (set by `check_structured`)."""
        return self._constraint

    def check_structured(self) -> None:
        """Resolve the fields into one constraint; 400 naming the fields when several are
        given, or the field whose value is malformed."""
        given: list[tuple[str, dict[str, Any]]] = []  # (field, {kind: value})
        if self.response_format is not None:
            spec = self.response_format.spec()
            if spec is not None:
                given.append(("response_format", spec))
        options, own = self._structured_outputs()
        given += own
        for field, kind in GUIDED.items():
            value = getattr(self, field)
            if value is not None:
                given.append((field, {kind: _parsed(field, value)}))
        if self.guided_whitespace_pattern is not None:
            options["whitespace_pattern"] = self.guided_whitespace_pattern
        if len(given) > 1:
            names = ", ".join(field for field, _ in given)
            message = f"at most one structured output constraint per request, got {names}"
            raise bad_request(message, given[1][0])
        if not given:
            if options:  # refused: unknown keys by name, else the missing constraint
                checked_constraint(options, "structured_outputs")
            return
        param, spec = given[0]
        _check_options(options)
        if "json" in spec and not isinstance(spec["json"], dict):
            raise bad_request(f"{param} must be a JSON schema (an object)", param)
        if "json" in spec:  # vLLM's default backend's strict mode (see above)
            options.setdefault("disable_additional_properties", True)
        # unknown keys of `structured_outputs` ride in `options`: the engine's check names them
        self._constraint = checked_constraint({**spec, **options}, param)

    def _structured_outputs(self) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
        """vLLM's `structured_outputs` object: its options, and its constraint (if any) as
        one more given constraint."""
        values = self.structured_outputs
        if values is None:
            return {}, []
        options = {
            k: v
            for k, v in values.items()
            if k not in KINDS and k not in IGNORED_OPTIONS and v is not None
        }
        given = [
            (f"structured_outputs.{k}", {k: _parsed(f"structured_outputs.{k}", v)})
            for k, v in values.items()
            if k in KINDS and v not in (None, False)
        ]
        return options, given


def _check_options(options: dict[str, Any]) -> None:
    """JSON's types for the known options (the engine also takes Triton clients' "true")."""
    for name, value in options.items():
        kind = str if name == "whitespace_pattern" else bool
        if name in (*FLAGS, "whitespace_pattern") and not isinstance(value, kind):
            what = "a string" if kind is str else "true or false"
            raise bad_request(f"{name} must be {what}", f"structured_outputs.{name}")


def _parsed(field: str, value: Any) -> Any:
    """A JSON schema (or structural tag) sent as text is parsed here, for a 400 naming it."""
    if not isinstance(value, str) or not field.endswith(("json", "structural_tag")):
        return value
    return parsed_json(value, field)
