"""Tool calls read from a model's text as it streams: the Hermes / Qwen2.5 format,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. The same parser serves streamed and whole answers (a whole answer is one
feed), so a stream's deltas joined are exactly the whole answer's message:

- `content` is the text before the first `<tool_call>` (its trailing whitespace dropped when a
  call follows; None when nothing is left); text after the first call that is not a call is
  dropped, as vLLM's Hermes parser does. Without a call, the content is the whole text.
- a call is announced (index, `call_...` id, type, name) as soon as its name is read, then its
  `arguments` follow as fragments of the raw JSON text the model wrote (the value of
  `arguments`, or of `parameters`; `{}` when the object has neither). A call cut short (by
  `max_tokens`) keeps the fragments it had; a block whose name cannot be read is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""

    def message(self) -> dict[str, Any]:
        """The call as a message's `tool_calls` entry."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class Delta:
    """What one piece of text adds: content, and per call its announcement and/or arguments."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add_call(self, call: ToolCall, arguments: str, announce: bool) -> None:
        if not (announce or arguments):
            return
        if self.calls and self.calls[-1]["index"] == call.index:
            self.calls[-1]["function"]["arguments"] += arguments
            return
        entry: dict[str, Any] = {"index": call.index}
        if announce:
            entry.update(id=call.id, type="function")
            entry["function"] = {"name": call.name, "arguments": arguments}
        else:
            entry["function"] = {"arguments": arguments}
        self.calls.append(entry)


class _Block:
    """One `<tool_call>` block: the JSON object after the tag scanned character by character
    (strings, escapes and nesting followed), the `name` and the span of the arguments' value."""

    def __init__(self) -> None:
        self.raw = ""
        self.pos = 0  # characters scanned
        self.started = False  # the object's `{` was seen
        self.junk = False  # not a JSON object: skipped to the end tag
        self.closed = False  # the object's `}` was seen
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.expect_key = True  # at depth 1: a key comes next (else a value)
        self.token_start = -1  # where the key or value being read starts
        self.key = ""
        self.values: dict[str, tuple[int, int]] = {}  # key -> (start, end) of its raw value
        self.args_key: str | None = None  # the first of `arguments` / `parameters` read
        self.last_solid = 0  # end of the last non-whitespace character scanned
        self.ended = False  # the end tag was seen
        self.rest = ""  # text after the end tag

    def feed(self, text: str) -> None:
        self.raw += text
        raw = self.raw
        while self.pos < len(raw) and not self.ended:
            c = raw[self.pos]
            if not self.in_string and c == "<":
                tail = raw[self.pos : self.pos + len(TOOL_CALL_END)]
                if tail == TOOL_CALL_END:
                    self.ended = True
                    self.rest = raw[self.pos + len(TOOL_CALL_END) :]
                    return
                if TOOL_CALL_END.startswith(tail):
                    return  # maybe the end tag: wait for more text
            if self.closed or self.junk:
                pass
            elif not self.started:
                if c == "{":
                    self.started, self.depth = True, 1
                elif not c.isspace():
                    self.junk = True
            else:
                self._scan(c)
            self.pos += 1

    def _scan(self, c: str) -> None:
        """One character of the object (depth >= 1)."""
        i = self.pos
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    self._token_end(i + 1)  # a key, or a string value
            self.last_solid = i + 1
            return
        if c.isspace():
            return
        self.last_solid = i + 1
        if self.depth == 1 and c in ",:}":
            self._token_end(i)  # a number, true, false or null ends here
            if c == "}":
                self.depth, self.closed = 0, True
            else:
                self.expect_key = c == ","
            return
        if self.depth == 1 and self.token_start < 0:
            self.token_start = i  # a key or a value starts
            if not self.expect_key and self.args_key is None and self.key in _ARGUMENT_KEYS:
                self.args_key = self.key
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]" and self.depth > 1:
            self.depth -= 1
            if self.depth == 1:
                self._token_end(i + 1)  # an object or array value ends

    def _token_end(self, end: int) -> None:
        """The key or value that started at `token_start` ends at `end` (whitespace before
        `end` excluded): a key is remembered, a value recorded under it (the first kept)."""
        start = self.token_start
        if start < 0:
            return
        self.token_start = -1
        text = self.raw[start:end].rstrip()
        if self.expect_key:
            try:
                self.key = str(json.loads(text))
            except ValueError:
                self.key = ""
        else:
            self.values.setdefault(self.key, (start, start + len(text)))

    @property
    def name(self) -> str | None:
        span = self.values.get("name")
        if span is None:
            return None
        try:
            value = json.loads(self.raw[span[0] : span[1]])
        except ValueError:
            return None
        return value if isinstance(value, str) and value else None

    def arguments(self) -> str:
        """The arguments' raw text scanned so far (all of it once its value ended); `{}` for
        an object without arguments."""
        if self.args_key is None:
            return "{}" if self.closed else ""
        if self.args_key in self.values:
            start, end = self.values[self.args_key]
            return self.raw[start:end]
        # still being read: whitespace counts only inside a string, object or array
        inside = self.depth > 1 or self.in_string
        return self.raw[self.token_start : self.pos if inside else self.last_solid]


class ToolCallParser:
    """Feed the model's text as it comes; each feed returns what it adds (`Delta`). `finish`
    at the end of the text; `content` and `calls` then hold the whole message."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel  # False: the first call only
        self.calls: list[ToolCall] = []
        self.pending = ""  # text not yet placed (a tag or trailing whitespace may follow)
        self.content_parts: list[str] = []
        self.block: _Block | None = None
        self.call: ToolCall | None = None  # the current block's call, once its name is read
        self.done = False  # no more calls are read

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return text if text or not self.calls else None

    def feed(self, text: str) -> Delta:
        delta = Delta()
        self.pending += text
        while not self.done:
            if self.block is not None:
                self.block.feed(self.pending)
                self.pending = ""
                self._advance(delta)
                if not self.block.ended:
                    break
                self.pending, self.block = self.block.rest, None
                self.done = not self.parallel and bool(self.calls)
                continue
            at = self.pending.find(TOOL_CALL_START)
            if at < 0:
                self._hold(delta)
                break
            if not self.calls:
                self._content(delta, self.pending[:at].rstrip())
            self.block, self.call = _Block(), None
            self.pending = self.pending[at + len(TOOL_CALL_START) :]
        if self.done:
            self.pending = ""
        return delta

    def finish(self) -> Delta:
        """The end of the text: content held back goes out when no call was made."""
        delta = Delta()
        if not self.calls and self.block is None:
            self._content(delta, self.pending)
        self.pending, self.block, self.done = "", None, True
        return delta

    def _hold(self, delta: Delta) -> None:
        """Outside a block: before any call, send the text that cannot begin a tag and is not
        trailing whitespace; after a call, drop it."""
        keep = _partial_suffix(self.pending, TOOL_CALL_START)
        if self.calls:
            self.pending = self.pending[len(self.pending) - keep :]
            return
        ready = self.pending[: len(self.pending) - keep].rstrip()
        self._content(delta, ready)
        self.pending = self.pending[len(ready) :]

    def _content(self, delta: Delta, text: str) -> None:
        if text:
            self.content_parts.append(text)
            delta.content += text

    def _advance(self, delta: Delta) -> None:
        """Announce the block's call once its name is known; send its new arguments."""
        block = self.block
        assert block is not None
        announce = self.call is None
        if announce:
            name = block.name
            if name is None:
                return
            self.call = ToolCall(len(self.calls), tool_call_id(), name)
            self.calls.append(self.call)
        assert self.call is not None
        arguments = block.arguments()
        new = arguments[len(self.call.arguments) :]
        self.call.arguments = arguments
        delta.add_call(self.call, new, announce)
