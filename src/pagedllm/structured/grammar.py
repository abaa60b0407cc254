"""Constraints turned into llguidance grammars, compiled once per distinct constraint (see
docs/structured_outputs.md for why that engine).

A compiled grammar is a pristine `LLMatcher`; each request gets a deep copy, advanced token
by token (`structured.matchers`). The cache is bounded: least recently used goes first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from pagedllm.structured.params import StructuredOutputsParams

CACHE_SIZE = 256


class GrammarCompiler:
    """Thread-safe: the engine compiles (to refuse a bad constraint before queueing it) and
    the model runner's mask thread copies matchers."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        """`tokenizer_json`: the HF `tokenizers` tokenizer as JSON (`Tokenizer.to_str()`);
        `vocab_size`: the model's logits width (it may exceed the tokenizer's vocabulary);
        `eos_token_ids`: what a complete grammar allows (and what ends the request)."""
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids
        )
        self.vocab_size = vocab_size
        added = json.loads(tokenizer_json).get("added_tokens") or []
        self.special_tokens = frozenset(t["content"] for t in added if t.get("special"))
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The pristine matcher for `spec` (cached). Raises ValueError naming what is wrong
        with a schema, regex or grammar."""
        key = spec.key
        with self._lock:
            if (matcher := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return matcher
        matcher = llguidance.LLMatcher(
            self.tokenizer, to_grammar(spec, self.special_tokens), log_level=0
        )
        if matcher.is_error():
            message = " ".join(matcher.get_error().split())[:1000]
            raise ValueError(f"invalid {spec.kind} constraint: {message}")
        with self._lock:
            self.misses += 1
            self._cache[key] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one request (a copy of the compiled grammar)."""
        return self.compile(spec).deep_copy()


def to_grammar(spec: StructuredOutputsParams, special_tokens: frozenset[str] = frozenset()) -> str:
    """llguidance's grammar definition of `spec`. Raises ValueError for text that is not
    JSON where JSON is needed, or a grammar that is neither Lark nor GBNF; the rest is
    checked when the grammar is compiled. `special_tokens`: the tokenizer's special tokens
    (a structural tag's trigger may be one, as Qwen2.5's `<tool_call>`, or plain text)."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _json_value("json", spec.json)
        return _json_grammar(spec, schema)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(str(spec.regex))
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice or ())))
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", str(spec.grammar))
        except ValueError as e:
            raise ValueError(f"invalid grammar constraint: {e}") from None
    tag = _json_value("structural_tag", spec.structural_tag)
    return _structural_tag_grammar(tag, special_tokens)


def _json_grammar(spec: StructuredOutputsParams, schema: Any) -> str:
    if not isinstance(schema, dict | bool):
        raise ValueError(f"json must be a JSON schema (an object), got {schema!r}")
    if spec.disable_additional_properties and isinstance(schema, dict):
        schema = _no_additional_properties(schema)
    options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]


def _json_value(name: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply") from None


def _no_additional_properties(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with `additionalProperties: false` on every object that does not say."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out

    return dict(walk(schema))


def _structural_tag_grammar(tag: Any, special_tokens: frozenset[str]) -> str:
    """vLLM / xgrammar's structural tag: {"type": "structural_tag", "structures": [{"begin",
    "schema", "end"}, ...], "triggers": [...]}. Text is free until a trigger; each structure
    whose `begin` starts with that trigger may follow, its body under `schema`."""
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list):
        raise ValueError("structural_tag must be an object with a list of structures")
    triggers = tag.get("triggers")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise ValueError("structural_tag needs a non-empty list of non-empty trigger strings")
    tags = []
    for i, s in enumerate(tag["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str):
            raise ValueError(f"structural_tag structures[{i}] needs a begin string")
        begin, end = s["begin"], s.get("end", "")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structural_tag structures[{i}].begin starts with no trigger")
        schema = s.get("schema", {"type": "object"})
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    if not tags:
        raise ValueError("structural_tag needs at least one structure")
    special = all(t.trigger in special_tokens for t in tags)
    return llguidance.StructTag.to_grammar(tags, assume_special=special)
