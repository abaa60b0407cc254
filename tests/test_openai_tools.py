"""The gateway's tool calling and structured-output requests without a server: the Hermes
tool-call parser on model-like text (streamed in random pieces, the deltas joined equal the
whole answer), the prompt (a template without tools gets Hermes' prompt, which equals what
transformers renders with a Qwen2.5-style template that has tools; a template with tools gets
them as transformers passes them), the tool-call grammars (compiled by the engine's
GrammarCompiler, which accepts calls and refuses what is not one) and the 400s of requests
that mix constraints."""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from openai_gateway import CHAT_TEMPLATE, MODEL

from conftest import TINY, build_tokenizer
from pagedllm.openai.chat import ChatTemplate
from pagedllm.openai.errors import APIError, from_triton
from pagedllm.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from pagedllm.openai.tool_parser import ToolCallParser
from pagedllm.openai.tools import NamedToolChoice, Tool, ToolUse, calls_grammar, template_inputs
from pagedllm.openai.triton import TritonError
from pagedllm.structured.grammar import GrammarCompiler
from pagedllm.structured.params import MAX_SPEC_CHARS, StructuredOutputsParams

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["utc_offset"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "A city's weather.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time.", "parameters": TIME},
    },
]
# a conversation with a round trip: two calls, their results
CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"utc_offset": 9}'}},
]  # fmt: skip
ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "The weather in Paris, and the time in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "21:04"},
]
# Qwen2.5's chat template (tools in the system turn, calls as <tool_call> blocks, results as
# <tool_response> blocks in a user turn) with the tiny tokenizer's <s> / </s> for its
# <|im_start|> / <|im_end|>: the turns are then those of test_openai's CHAT_TEMPLATE
QWEN_LIKE = """\
{%- if tools %}
{{- '<s>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call></s>\\n" }}
{%- elif messages[0]['role'] == 'system' %}{{- '<s>system\\n' + messages[0]['content'] + '</s>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<s>' + message.role + '\\n' + message.content + '</s>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<s>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '</s>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<s>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '</s>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<s>assistant\\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


def tool_use(choice: Any = "auto", parallel: bool | None = None) -> ToolUse:
    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    use = ToolUse.of([Tool.model_validate(t) for t in TOOLS], choice, parallel)
    assert use is not None
    return use


def hf_render(tokenizer_dir: Path, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """transformers' apply_chat_template with QWEN_LIKE; calls' arguments as objects, as
    transformers' users write them."""
    import transformers

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = hf.apply_chat_template(
        messages, chat_template=QWEN_LIKE, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return str(text)


def render(template: str, messages: list[dict[str, Any]], tools: ToolUse | None) -> str:
    chat = ChatTemplate(template, "<s>", "</s>")
    body = parse_body(ChatCompletionRequest, {"model": MODEL, "messages": messages})
    return chat.render(*template_inputs(body.template_messages(), tools, chat.accepts_tools))


# --- the prompt -------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["hermes-fallback", "native"])
def test_tools_and_round_trip_render_as_transformers(tokenizer_dir: Path, template: str) -> None:
    """A template without tools (test_openai's ChatML-like one, as SmolLM2's) gets Hermes'
    prompt: the same text transformers renders with the Qwen2.5-style template and `tools`;
    that template itself renders the tools natively, equal to transformers too."""
    source = CHAT_TEMPLATE if template == "hermes-fallback" else QWEN_LIKE
    assert ChatTemplate(source).accepts_tools == (template == "native")
    expected = hf_render(tokenizer_dir, ROUND_TRIP, tools=TOOLS)
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>\n<tool_response>" in expected
    assert render(source, ROUND_TRIP, tool_use()) == expected
    # without tools in the request, the calls and results still render (no tool prompt)
    assert render(source, ROUND_TRIP, None) == hf_render(tokenizer_dir, ROUND_TRIP)


def test_bad_arguments_in_a_call_sent_back() -> None:
    messages = copy.deepcopy(ROUND_TRIP)
    messages[2]["tool_calls"][1]["function"]["arguments"] = "{not json"
    with pytest.raises(APIError) as e:
        render(QWEN_LIKE, messages, tool_use())
    assert e.value.param == "messages[2].tool_calls[1].function.arguments"
    assert "is not valid JSON" in e.value.message


# --- the parser -------------------------------------------------------------------------------


def parse_whole(text: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    parser = ToolCallParser(parallel)
    parser.feed(text)
    parser.finish()
    return parser.content, [(c.name, c.arguments) for c in parser.calls]


def parse_streamed(text: str, seed: int, parallel: bool = True) -> tuple[Any, ...]:
    """The deltas of `text` fed in random pieces, joined as a client joins them."""
    rng, parser = random.Random(seed), ToolCallParser(parallel)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        pieces.append(parser.feed(text[i : i + n]))
        i += n
    pieces.append(parser.finish())
    content, calls = "", {}
    for delta in pieces:
        content += delta.content
        for entry in delta.calls:
            if "id" in entry:  # the first delta of a call: its id, type and name
                assert entry["index"] not in calls and entry["id"].startswith("call_")
                assert entry["type"] == "function"
                calls[entry["index"]] = [entry["function"]["name"], ""]
            assert set(entry["function"]) <= {"name", "arguments"}
            calls[entry["index"]][1] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return (content if content or not calls else None), [tuple(calls[i]) for i in sorted(calls)]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"<x>\\"", "unit": "celsius"}}\n</tool_call>'
# (model-like text, content, calls)
PARSED: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("No tool needed.  \n", "No tool needed.  \n", []),
    ("A <tool but no call", "A <tool but no call", []),
    (CALL, None, [("get_weather", '{"city": "Pa}ris \\"<x>\\"", "unit": "celsius"}')]),
    (f"Let me check.\n\n{CALL}\n", "Let me check.", [("get_weather", '{"city": "Pa}ris \\"<x>\\"", "unit": "celsius"}')]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"utc_offset": 9}}\n</tool_call>\n<tool_call>\n{"arguments": {"s": "</tool_call>"}, "name": "echo"}\n</tool_call>\nBye',
     None, [("get_time", '{"utc_offset": 9}'), ("echo", '{"s": "</tool_call>"}')]),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", "{}")]),
    ('<tool_call>{"name": "f", "parameters": [1, {"a": [2]}] }</tool_call>', None, [("f", '[1, {"a": [2]}]')]),
    # cut short by max_tokens: the arguments so far
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lon', None, [("get_weather", '{"city": "Lon')]),
    ('<tool_call>\n{"name": "get_time", "arguments": 1', None, [("get_time", "1")]),
    # a block whose name cannot be read is dropped
    ("<tool_call>not json</tool_call>", "", []),
]  # fmt: skip


@pytest.mark.parametrize("case", PARSED, ids=range(len(PARSED)))
def test_parser_streamed_equals_whole(case: tuple[str, Any, Any]) -> None:
    text, content, calls = case
    assert parse_whole(text) == (content, calls)
    for seed in range(30):
        assert parse_streamed(text, seed) == (content, calls)


def test_parser_without_parallel_calls_keeps_the_first() -> None:
    text = PARSED[4][0]
    assert parse_whole(text, parallel=False) == (None, [("get_time", '{"utc_offset": 9}')])
    assert parse_streamed(text, 0, parallel=False) == parse_whole(text, parallel=False)


# --- the grammars -----------------------------------------------------------------------------


def accepts(compiler: GrammarCompiler, tokenizer: Any, spec: dict[str, Any], text: str) -> bool:
    """The constraint's matcher takes all of `text` and may end there."""
    matcher = compiler.matcher(StructuredOutputsParams.from_dict(spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


def test_tool_choice_grammars(tokenizer_dir: Path) -> None:
    from pagedllm.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(tokenizer_dir)
    compiler = GrammarCompiler(tokenizer.to_json(), TINY["vocab_size"], [1])
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    time = '<tool_call>\n{"name": "get_time", "arguments": {"utc_offset": -3}}\n</tool_call>'
    bad = [
        "Sure!",
        weather.replace("celsius", "kelvin"),  # not in the enum
        time.replace("-3", "15"),  # above the maximum
        weather.replace("get_weather", "get_wetter"),  # no such tool
        weather.replace('", "unit": "celsius"', '"'),  # a required argument missing
    ]  # fmt: skip
    specs = {
        "required": (tool_use("required").constraint(frozenset()), [weather, time, f"{weather}\n{time}"]),
        "one": (tool_use("required", parallel=False).constraint(frozenset()), [weather, time]),
        "named": (tool_use({"type": "function", "function": {"name": "get_time"}}).constraint(frozenset()), [time]),
    }  # fmt: skip
    for name, (constraint, good) in specs.items():
        assert constraint is not None and constraint.param == "tools"
        for text in good:
            assert accepts(compiler, tokenizer, constraint.spec, text), (name, text)
        others = [t for t in (weather, time, f"{weather}\n{time}") if t not in good]
        for text in bad + others:
            assert not accepts(compiler, tokenizer, constraint.spec, text), (name, text)
    auto = tool_use("auto").constraint(frozenset())
    assert auto is not None
    for text in ("Sure!", f"Let me see.\n{weather}", f"{time}\nDone."):
        assert accepts(compiler, tokenizer, auto.spec, text), text
    assert not accepts(compiler, tokenizer, auto.spec, weather.replace("celsius", "kelvin"))
    # a tag that is a special token of the tokenizer is written as that token
    grammar = calls_grammar([Tool.model_validate(TOOLS[1])], "one", frozenset(["<tool_call>"]))
    assert "call_0: <tool_call> " in grammar and '"}\\n" "</tool_call>"' in grammar


# --- requests -------------------------------------------------------------------------------


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
# (body fields, param, what the message says)
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": SCHEMA_FORMAT, "guided_regex": "a+"}, "guided_regex", "at most one structured output constraint per request, got response_format, guided_regex"),
    ({"guided_json": WEATHER, "guided_choice": ["a"]}, "guided_choice", "got guided_json, guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "got structured_outputs.regex, structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs.regex", "got response_format, structured_outputs.regex"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown structured_outputs keys: jsn"),
    ({"structured_outputs": {"regex": "a", "jsn": 1}}, "structured_outputs.regex", "unknown structured_outputs keys: jsn"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "need exactly one of json"),
    ({"guided_regex": "a", "structured_outputs": {"disable_any_whitespace": "yes"}}, "structured_outputs.disable_any_whitespace", "must be true or false"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "must be a JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "Input should be"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "choice must be a list of 1 to"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "names the function 'nope', which is not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Input should be"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "two tools are named 'get_weather'"),
    ({"tools": [TOOLS[1]] * 129}, "tools", "tools: at most 128 tools, got 129"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "foo": 1}}]}, "tools[0].function.foo", "Unrecognized request argument"),
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=[c[1] for c in REFUSED])
def test_refused_requests(case: tuple[dict[str, Any], str, str]) -> None:
    fields, param, message = case
    with pytest.raises(APIError) as e:
        body = parse_body(ChatCompletionRequest, chat(**fields))
        ToolUse.of(body.tools, body.tool_choice, body.parallel_tool_calls)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert message in e.value.message


def test_tools_refused_fast() -> None:
    """OpenAI's cap of 128 tools, checked before the names (whose check is linear): a body of
    50 000 tools is refused at once."""
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(50_000)]
    body = parse_body(ChatCompletionRequest, chat(tools=tools))
    start = time.perf_counter()
    with pytest.raises(APIError) as e:
        ToolUse.of(body.tools, None, None)
    assert time.perf_counter() - start < 0.5
    assert e.value.param == "tools" and "at most 128 tools" in e.value.message
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f127"}})
    use = ToolUse.of(body.tools[:128], named, None)
    assert use is not None and use.choice == "f127"


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tools_too_large_for_the_engine_name_tools(choice: str) -> None:
    """A tool-call grammar over the engine's size limit: 400 naming `tools`, not the grammar or
    structural tag the gateway built from them."""
    values = {"type": "string", "enum": [f"value {i}" for i in range(MAX_SPEC_CHARS // 8)]}
    parameters = {"type": "object", "properties": {"x": values}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    use = ToolUse.of([Tool.model_validate(t) for t in tools], choice, None)
    assert use is not None
    with pytest.raises(APIError) as e:
        use.constraint(frozenset())
    assert (e.value.status, e.value.param) == (400, "tools")
    assert e.value.message.startswith("tools: ") and "too large" in e.value.message


def test_engine_refusal_of_the_tools_constraint_names_tools() -> None:
    """The engine's refusal speaks of the constraint it was sent (a grammar, a structural tag):
    the answer puts the field the client sent first, `tools` for the tools' grammar."""
    refusal = TritonError(400, "the structural_tag constraint is too large: 300000 characters")
    error = from_triton(refusal, "messages", "tools")
    assert (error.status, error.param) == (400, "tools")
    assert error.message == f"tools: {refusal.message}"


def test_constraints_resolved() -> None:
    """Each spelling becomes the engine's structured_outputs; options join any of them."""
    cases: list[tuple[dict[str, Any], dict[str, Any] | None]] = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": SCHEMA_FORMAT, "structured_outputs": {"disable_any_whitespace": True}},
         {"json": WEATHER, "disable_any_whitespace": True, "disable_additional_properties": True}),
        ({"guided_json": json.dumps(WEATHER), "guided_whitespace_pattern": " ?"},
         {"json": WEATHER, "whitespace_pattern": " ?", "disable_additional_properties": True}),
        # a JSON schema's objects allow no other properties unless the request says so
        ({"guided_json": WEATHER, "structured_outputs": {"disable_additional_properties": False}},
         {"json": WEATHER, "disable_additional_properties": False}),
        ({"guided_regex": "[a-z]+", "guided_decoding_backend": "xgrammar"}, {"regex": "[a-z]+"}),
        ({"structured_outputs": {"choice": ["yes", "no"], "backend": "guidance"}}, {"choice": ["yes", "no"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    ]  # fmt: skip
    for fields, spec in cases:
        for model, body in (
            (ChatCompletionRequest, chat(**fields)),
            (CompletionRequest, {"model": MODEL, "prompt": "x", **fields}),
        ):
            constraint = parse_body(model, body).constraint
            assert (constraint and constraint.spec) == spec, fields
    body = parse_body(
        ChatCompletionRequest, chat(tools=TOOLS, response_format={"type": "json_object"})
    )
    use = ToolUse.of(body.tools, "auto", None)
    assert use is not None and use.resolve(body.constraint, frozenset()) == (body.constraint, False)
    with pytest.raises(APIError) as e:
        tool_use("required").resolve(body.constraint, frozenset())
    assert e.value.param == "response_format" and "cannot be combined" in e.value.message
