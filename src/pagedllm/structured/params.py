"""What a request's output must match: vLLM's `StructuredOutputsParams` names and meanings.

Exactly one constraint per request: `json` (a JSON schema, as a dict or its text),
`json_object` (any JSON object), `regex`, `choice` (one of these strings), `grammar` (Lark,
or GBNF / EBNF as llama.cpp and xgrammar write it) or `structural_tag` (free text in which
each trigger opens a constrained segment: the tool-call form). `pagedllm.structured.grammar`
compiles it (that module needs llguidance; this one does not).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from pagedllm.convert import to_bool

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# the options' flags (vLLM's names); `disable_fallback` and `backend` are accepted for vLLM
# clients and change nothing: there is one grammar engine and no fallback
FLAGS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
MAX_SPEC_CHARS = 1 << 18  # a schema, regex or grammar longer than this is refused
MAX_SPEC_DEPTH = 64  # levels of objects and arrays in a schema or structural tag
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("json_object", *FLAGS):  # "true" / "false" from Triton clients
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, to_bool(name, value))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            which = f"got {', '.join(given)}" if given else "none given"
            raise ValueError(f"structured outputs need exactly one of {', '.join(KINDS)}: {which}")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or len(self.choice) > MAX_CHOICES
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"choice must be a list of 1 to {MAX_CHOICES} strings")
        for name in ("json", "structural_tag"):
            check_depth(name, getattr(self, name))
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        if len(self.key) > MAX_SPEC_CHARS:
            raise ValueError(
                f"the {self.kind} constraint is too large: {len(self.key)} characters, the"
                f" limit is {MAX_SPEC_CHARS}"
            )

    @staticmethod
    def from_dict(values: dict[str, Any]) -> StructuredOutputsParams:
        if not isinstance(values, dict):
            raise ValueError(f"structured_outputs must be an object, got {values!r}")
        names = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown structured_outputs keys: {', '.join(unknown)}")
        return StructuredOutputsParams(**values)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @functools.cached_property
    def key(self) -> str:
        """The constraint and its options as text: equal keys compile to the same grammar."""
        value = getattr(self, self.kind)
        spec = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        options = [self.disable_any_whitespace, self.disable_additional_properties]
        return f"{self.kind}:{options}:{self.whitespace_pattern}:{spec}"


def check_depth(name: str, value: Any) -> None:
    """Refuse JSON nested deeper than MAX_SPEC_DEPTH (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list | tuple):
            if depth > MAX_SPEC_DEPTH:
                raise ValueError(f"{name} is nested too deeply (more than {MAX_SPEC_DEPTH} levels)")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
