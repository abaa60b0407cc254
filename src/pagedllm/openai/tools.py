"""OpenAI's `tools` and `tool_choice` on chat completions: what the model is shown, what its
output is constrained to, and whether its text is read for tool calls.

The tool-call format is Hermes / Qwen2.5's (`tool_parser`): `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>` blocks.

- Prompt: a chat template that uses a `tools` variable gets the tools as `transformers`'
  `apply_chat_template(tools=...)` passes them (and assistant `tool_calls` with their
  `arguments` parsed into objects, as vLLM passes them). A template without one (SmolLM2's
  ChatML) gets Hermes' own prompt instead, in the messages: the tools and the call format in
  the system message, assistant calls as `<tool_call>` blocks, `tool` messages as a user turn
  of `<tool_response>` blocks (as Qwen2.5's template renders them).
- Output: `required` and a named function are enforced by a Lark grammar: one call of the
  named function, or one or more calls of any tool (one with `parallel_tool_calls: false`),
  each call's arguments under its `parameters` schema, and nothing else. `auto` constrains
  with a structural tag triggered by `<tool_call>`: free text, but a call once begun names a
  tool and has valid arguments. `none` leaves the output alone and reads no calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pagedllm.openai.errors import bad_request, parsed_json
from pagedllm.openai.structured import Constraint, Strict, checked_constraint, closed_objects
from pagedllm.openai.tool_parser import TOOL_CALL_END, TOOL_CALL_START

# the arguments are written as json.dumps writes them (as `tojson` renders them in a prompt)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_ARGUMENTS = {"type": "object"}
MAX_TOOLS = 128  # OpenAI's limit on `tools`
# Hermes' / Qwen2.5's tool prompt, for templates that do not render tools themselves
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] | None = None


class MessageToolCall(BaseModel):
    """A call in an assistant message sent back (other keys, e.g. `index`, are kept)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, its resolved choice (`none`, `auto`, `required` or a function's
    name) and whether calls may be parallel."""

    tools: tuple[Tool, ...]
    choice: str
    named: bool = False
    parallel: bool = True

    @staticmethod
    def of(
        tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None
    ) -> ToolUse | None:
        """None without tools; 400 for a choice that names no given tool."""
        if not tools:
            if choice is not None and choice != "none":
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        if len(tools) > MAX_TOOLS:
            raise bad_request(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
        names: set[str] = set()
        for i, tool in enumerate(tools):
            name = tool.function.name
            if not name:
                raise bad_request("a function needs a name", f"tools[{i}].function.name")
            if name in names:
                raise bad_request(f"two tools are named {name!r}", f"tools[{i}].function.name")
            names.add(name)
        parallel = True if parallel is None else parallel
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in names:
                message = f"tool_choice names the function {name!r}, which is not in tools"
                raise bad_request(message, "tool_choice.function.name")
            return ToolUse(tuple(tools), name, named=True, parallel=parallel)
        return ToolUse(tuple(tools), choice or "auto", parallel=parallel)

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as the chat template (or Hermes' prompt) shows them."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self, special_tokens: frozenset[str]) -> Constraint | None:
        """The grammar of the choice (None for `none`), checked as the engine checks it (400
        naming `tools`, e.g. too large). `special_tokens`: the tokenizer's; a tag that is one
        is written as that token."""
        if self.choice == "none":
            return None
        if self.choice == "auto":
            structures = [
                {
                    "begin": f'{TOOL_CALL_START}\n{{"name": {_json(t.function.name)}, '
                    '"arguments": ',
                    "schema": _arguments_schema(t),
                    "end": f"}}\n{TOOL_CALL_END}",
                }
                for t in self.tools
            ]
            tag = {"type": "structural_tag", "structures": structures}
            return checked_constraint(
                {"structural_tag": {**tag, "triggers": [TOOL_CALL_START]}}, "tools"
            )
        tools = [t for t in self.tools if not self.named or t.function.name == self.choice]
        grammar = calls_grammar(tools, self.calls, special_tokens)
        return checked_constraint({"grammar": grammar}, "tools")

    def resolve(
        self, constraint: Constraint | None, special_tokens: frozenset[str]
    ) -> tuple[Constraint | None, bool]:
        """The request's constraint with the tools', and whether calls are read from the
        output. A response format and `auto` (or `none`): the format constrains the output,
        which is not read for calls; with `required` or a named function, 400."""
        if constraint is None:
            return self.constraint(special_tokens), self.reads_calls
        if self.choice in ("none", "auto"):
            return constraint, False
        message = f"{constraint.param} cannot be combined with tool_choice {self.choice!r}"
        raise bad_request(message, constraint.param)

    def keeps_special_tokens(self, special_tokens: frozenset[str]) -> bool:
        """The tags are special tokens of the tokenizer: the output text must keep special
        tokens for the calls to be read (vLLM's Hermes parser asks the same)."""
        return self.reads_calls and bool({TOOL_CALL_START, TOOL_CALL_END} & special_tokens)

    @property
    def calls(self) -> str:
        """How many calls the grammar allows: `one` or `many` (one or more)."""
        return "many" if self.parallel and not self.named else "one"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    # objects that do not say allow no other properties, as a `json` constraint (structured)
    given = tool.function.parameters
    schema: dict[str, Any] = closed_objects(dict(given)) if given else dict(ANY_ARGUMENTS)
    return {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}


def calls_grammar(tools: list[Tool], calls: str, special_tokens: frozenset[str]) -> str:
    """A Lark grammar (llguidance's dialect) of `calls` (`one`, `many`) tool-call blocks of
    `tools`, separated by newlines; each call's arguments under its `parameters` schema."""

    def tag(text: str) -> str:
        return text if text in special_tokens else json.dumps(text)

    lines = ["%llguidance {}", "start: call" if calls == "one" else 'start: call ("\\n" call)*']
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = _json(f'\n{{"name": {_json(tool.function.name)}, "arguments": ')
        schema = _json(_arguments_schema(tool))
        lines.append(
            f'call_{i}: {tag(TOOL_CALL_START)} {head} %json {schema} "}}\\n" {tag(TOOL_CALL_END)}'
        )
    return "\n".join(lines) + "\n"


# --- the prompt ------------------------------------------------------------------------------


def template_inputs(
    messages: list[dict[str, Any]], tools: ToolUse | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` to render. `native`: the template renders tools itself."""
    definitions = tools.definitions() if tools is not None else None
    if native:
        return [_parsed_calls(i, m) for i, m in enumerate(messages)], definitions
    if definitions is None and not any(_has_tool_parts(m) for m in messages):
        return messages, None
    return hermes_messages(messages, definitions), None


def _has_tool_parts(message: dict[str, Any]) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def _parsed_calls(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose calls' `arguments` (JSON text) are objects, as templates
    expect them (Qwen2.5's writes `arguments | tojson`)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for j, call in enumerate(message["tool_calls"]):
        function = dict(call["function"])
        function["arguments"] = _arguments(index, j, function.get("arguments"))
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _arguments(index: int, j: int, arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments if arguments is not None else {}
    if not arguments.strip():
        return {}
    return parsed_json(arguments, f"messages[{index}].tool_calls[{j}].function.arguments")


def hermes_messages(
    messages: list[dict[str, Any]], definitions: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The messages with Hermes' tool prompt in the system message (`definitions`: the tools,
    or None), calls as `<tool_call>` blocks and tool results as `<tool_response>` blocks in a
    user turn (consecutive results in one)."""
    out: list[dict[str, Any]] = []
    responses: dict[str, Any] | None = None  # the user turn of the latest tool results
    for i, message in enumerate(messages):
        if message.get("role") == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if responses is None:
                responses = {"role": "user", "content": response}
                out.append(responses)
            else:
                responses["content"] += "\n" + response
            continue
        responses = None
        calls = message.get("tool_calls")
        message = {k: v for k, v in message.items() if k != "tool_calls"}
        if calls:
            blocks = [message["content"]] if message.get("content") else []
            for j, call in enumerate(calls):
                function = call["function"]
                arguments = _arguments(i, j, function.get("arguments"))
                body = json.dumps(
                    {"name": function["name"], "arguments": arguments}, ensure_ascii=False
                )
                blocks.append(f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}")
            message["content"] = "\n".join(blocks)
        out.append(message)
    if definitions is None:
        return out
    prompt = HERMES_TOOLS.format(
        tools="".join("\n" + json.dumps(d, ensure_ascii=False) for d in definitions)
    )
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
