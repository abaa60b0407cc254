"""Constraints turned into llguidance grammars, compiled once per distinct constraint (see
docs/structured_outputs.md for why that engine).

A compiled grammar is a pristine `LLMatcher`; each request gets a deep copy, advanced token
by token (`structured.matchers`). The cache is bounded in entries and in the constraints'
size (a compiled 200k-character schema holds ~70 MB): least recently used goes first.

NOTE: llguidance's grammar compiler recurses natively once per link of a rule or `$ref`
chain: a few thousand links overflow a thread's default stack and crash the process. Every
compile and validation runs on a fresh thread with a large stack (`on_big_stack`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import llguidance

from pagedllm.structured.params import StructuredOutputsParams, check_depth

T = TypeVar("T")
CACHE_SIZE = 256
CACHE_CHARS = 1 << 20  # the cached constraints' text, in all
COMPILE_STACK = 256 << 20  # bytes of stack for a compile (virtual memory, reserved only)
_stack_lock = threading.Lock()


def on_big_stack(fn: Callable[[], T]) -> T:
    """`fn()` on a new thread with a `COMPILE_STACK`-byte stack; its result or its error."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:
            box.append((False, e))

    with _stack_lock:  # the stack size is process-wide, for threads started after it is set
        previous = threading.stack_size(COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="grammar-compile")
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


class GrammarCompiler:
    """Thread-safe: the engine compiles (to refuse a bad constraint before queueing it) and
    the model runner's mask thread copies matchers."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int = CACHE_SIZE,
        cache_chars: int = CACHE_CHARS,
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
        self._cache_chars = cache_chars
        self._chars = 0
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
        matcher = on_big_stack(lambda: self._build(spec))
        with self._lock:
            self.misses += 1
            if key not in self._cache:
                self._cache[key] = matcher
                self._chars += len(key)
            while len(self._cache) > self._cache_size or (
                self._chars > self._cache_chars and len(self._cache) > 1
            ):
                old_key, _ = self._cache.popitem(last=False)
                self._chars -= len(old_key)
        return matcher

    def _build(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(
            self.tokenizer, to_grammar(spec, self.special_tokens), log_level=0
        )
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} constraint: {_message(matcher)}")
        # the first mask builds the lexer: a grammar beyond the engine's limits fails here,
        # before the request is queued, not in the middle of its output
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise ValueError(
                f"the {spec.kind} constraint is too complex for the grammar engine:"
                f" {_message(probe)}"
            )
        return matcher

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one request (a copy of the compiled grammar)."""
        return self.compile(spec).deep_copy()


def _message(matcher: llguidance.LLMatcher) -> str:
    return " ".join(matcher.get_error().split())[:1000]


def validate(spec: StructuredOutputsParams) -> None:
    """Refuse a constraint that does not compile, without a tokenizer (for a caller with
    no engine): ValueError "invalid <kind> constraint: ...", as `GrammarCompiler.compile`."""
    error = on_big_stack(lambda: llguidance.LLMatcher.validate_grammar(to_grammar(spec)))
    if error:
        raise ValueError(f"invalid {spec.kind} constraint: {' '.join(error.split())[:1000]}")


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
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply") from None
    check_depth(name, parsed)
    return parsed


def _no_additional_properties(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with `additionalProperties: false` on every object schema that does not
    say; only subschemas are visited (not `const`, `enum` or `default` values)."""

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in _SUBSCHEMA:
            if isinstance(out.get(key), dict):
                out[key] = walk(out[key])
        for key in _SUBSCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [walk(v) for v in out[key]]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {k: walk(v) for k, v in out[key].items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out

    return dict(walk(schema))


# JSON Schema keywords whose value is a subschema, a list of them, or a map of them
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


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
