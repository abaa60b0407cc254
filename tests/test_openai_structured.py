"""Structured outputs and tool calls through `pagedllm openai` (test_openai's real tritonserver
and gateway, tiny llama fp32, whose ChatML-like template has no tools: the Hermes prompt), and
a second gateway on the same server with a Qwen2.5-style template that renders tools itself.
Clients: the official `openai` package (`parse` with pydantic models), httpx, `instructor`
and `langchain-openai`. The tiny model's text is random: every schema here ends (enums,
booleans, bounded integers, strings with maxLength) and the oracles are independent of the
gateway: `jsonschema`, `re.fullmatch`, membership, and transformers' rendering of the prompt
(its token count)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
import test_openai
from openai_gateway import MODEL, running_gateway, warm_gateway, with_chat_template
from pydantic import BaseModel, Field
from test_openai import MESSAGES as _MESSAGES
from test_openai_tools import QWEN_LIKE, TOOLS, WEATHER, hf_render

from conftest import make_checkpoint, serving
from pagedllm.serving.tritonserver import TritonServer
from pagedllm.text.tokenizer import Tokenizer

MESSAGES: Any = _MESSAGES  # the clients' message types are TypedDicts
client, tokenizer = test_openai.client, test_openai.tokenizer

SEEDED: dict[str, Any] = {"temperature": 1.0, "seed": 11, "max_completion_tokens": 200}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
FORECAST = {
    **WEATHER,
    "properties": {
        **WEATHER["properties"],
        "sunny": {"type": "boolean"},
        "degrees": {"type": "integer", "minimum": -40, "maximum": 45},
    },
    "required": ["city", "unit", "sunny", "degrees"],
}
FORECAST_FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]
    sunny: bool
    degrees: int = Field(ge=-40, le=45)


class GetTime(BaseModel):
    utc_offset: int = Field(ge=-12, le=14)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_openai's tiny llama and template, with room for tool prompts (2048 positions: the
    tiny tokenizer spells the tools' JSON in ~700 tokens)."""
    path = make_checkpoint(
        tmp_path_factory.mktemp("structured") / MODEL, "llama", max_position_embeddings=2048
    )
    return with_chat_template(path)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    yield from serving(model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def gateway(
    server: TritonServer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with warm_gateway(server, model_dir, tmp_path_factory.mktemp("gateway") / "gateway.log") as url:
        yield url


@pytest.fixture(scope="module")
def native_client(
    server: TritonServer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    """A second gateway on the same server, with the Qwen2.5-style template (tools native)."""
    work = tmp_path_factory.mktemp("native")
    (work / "qwen.jinja").write_text(QWEN_LIKE)
    args = ("--chat-template", str(work / "qwen.jinja"))
    with running_gateway(server, model_dir, work / "gateway.log", *args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, stream: bool = False, **kwargs: Any) -> Any:
    kwargs = {"model": MODEL, "messages": MESSAGES, **SEEDED, **kwargs}
    return client.chat.completions.create(stream=stream, **kwargs)


# --- response formats and vLLM's constraints --------------------------------------------------


def test_json_schema_streamed_and_not(client: openai.OpenAI) -> None:
    out = chat(client, n=2, response_format=FORECAST_FORMAT, extra_body=COMPACT)
    texts = [c.message.content for c in out.choices]
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), FORECAST)
    assert texts[0] != texts[1]  # seeds 11 and 12
    streamed = ["", ""]
    for chunk in chat(client, True, n=2, response_format=FORECAST_FORMAT, extra_body=COMPACT):
        streamed[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert streamed == texts
    # whitespace allowed: still valid; completions take the same fields
    out = chat(client, response_format=FORECAST_FORMAT)
    jsonschema.validate(json.loads(out.choices[0].message.content), FORECAST)
    done = client.completions.create(
        model=MODEL, prompt="Weather:", temperature=1.0, seed=5, max_tokens=200,
        extra_body={"response_format": FORECAST_FORMAT, **COMPACT},
    )  # fmt: skip
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), FORECAST)


def test_objects_without_additional_properties_allow_none(client: openai.OpenAI) -> None:
    """A schema whose objects do not say `additionalProperties` gets no other keys, as vLLM's
    default backend (xgrammar, strict mode) and OpenAI's `strict` schemas: in a response
    format, vLLM's `guided_json`, and a tool's parameters."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    for fields in ({"response_format": response_format}, {"extra_body": {"guided_json": schema}}):
        out = chat(client, n=3, **fields)
        assert [set(json.loads(c.message.content)) for c in out.choices] == [{"ok"}] * 3
    tool = {"type": "function", "function": {"name": "check", "parameters": schema}}
    named = {"type": "function", "function": {"name": "check"}}
    out = chat(client, n=3, tools=[tool], tool_choice=named)
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"ok"}


def test_openai_parse_with_pydantic(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Forecast, extra_body=COMPACT, **SEEDED
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Forecast), out
    jsonschema.validate(parsed.model_dump(), FORECAST)
    # a strict function tool: its arguments parsed too
    out = client.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetTime)],
        tool_choice="required",
        parallel_tool_calls=False,  # the random model could go on calling
        **SEEDED,
    )
    calls = out.choices[0].message.tool_calls
    assert calls is not None and isinstance(calls[0].function.parsed_arguments, GetTime), out


def test_regex_choice_grammar_and_length(client: openai.OpenAI) -> None:
    regex = r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)"
    extra: dict[str, Any]
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        out = client.completions.create(
            model=MODEL, prompt="Mail:", n=2, seed=1, max_tokens=40, extra_body=extra
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop" and re.fullmatch(regex, choice.text), choice
    choices = ["yes", "no", "maybe not"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        out = chat(client, n=3, extra_body=extra)
        assert all(c.message.content in choices for c in out.choices)
    # GBNF and Lark
    grammars = [
        'root ::= ("yes" | "no") " " [0-9] [0-9]?',
        'start: ("yes" | "no") " " /[0-9]{1,2}/',
    ]
    for grammar in grammars:
        out = chat(client, n=2, extra_body={"guided_grammar": grammar})
        for choice in out.choices:
            assert re.fullmatch(r"(yes|no) [0-9]{1,2}", choice.message.content), choice
    # max_tokens cuts the document: "length", as vLLM
    out = chat(client, response_format=FORECAST_FORMAT, max_completion_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith("{")


# (field, value, what the engine's message says)
ENGINE_REFUSALS = [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "Invalid type: objekt"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}, "/$defs/nope"),
    ("guided_regex", "((", "unclosed group"),
    ("guided_grammar", "start: foo", 'unknown name: "foo"'),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "Invalid type: objekt"),
]  # fmt: skip


@pytest.mark.parametrize("case", ENGINE_REFUSALS, ids=[c[0] for c in ENGINE_REFUSALS])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_answer_400(gateway: str, case: tuple[str, Any, str], stream: bool) -> None:
    """The engine refuses the constraint before it generates: a plain 400 naming the field (in
    the message too: the engine's words name the constraint it got, for tools a grammar)."""
    field, value, message = case
    body = {"model": MODEL, "messages": MESSAGES, field: value, "stream": stream}
    if field == "tools":
        body["tool_choice"] = "required"
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and message in error["message"], error
    assert error["message"].startswith(f"{field}: "), error


# --- tools --------------------------------------------------------------------------------


def streamed_calls(chunks: Iterator[Any]) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """A streamed answer's content, tool calls joined from their deltas, finish reason."""
    content, finish = "", None
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: index, id, type and name
                assert delta.index == len(calls) and delta.id.startswith("call_")
                assert delta.type == "function" and delta.function.name
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, calls, finish


def checked_calls(message: Any, allowed: set[str]) -> list[dict[str, Any]]:
    """The message's calls, each a tool of `allowed` with arguments valid under its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        calls.append({"id": call.id, **call.function.model_dump()})
    return calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_streamed_equal_whole(client: openai.OpenAI, parallel: bool) -> None:
    kwargs: dict[str, Any] = {
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
    }
    out = chat(client, n=2, **kwargs)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = checked_calls(choice.message, {"get_weather", "get_time"})
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        # the same seed streamed: the deltas join to the same calls (ids are new)
        seeded = {**kwargs, "seed": SEEDED["seed"] + choice.index}
        content, streamed, finish = streamed_calls(chat(client, True, **seeded))
        assert (content, finish) == (None, "tool_calls")
        assert [{**c, "id": None} for c in streamed] == [{**c, "id": None} for c in calls]


def round_trip(client: openai.OpenAI, stream: bool) -> tuple[Any, int, str]:
    """A named call, its result sent back, the final answer: (the call, prompt tokens of the
    answer, its text)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The weather in Paris?"},
    ]
    if stream:
        _, calls, finish = streamed_calls(
            chat(client, True, messages=messages, tools=TOOLS, tool_choice=named)
        )
        assert finish == "tool_calls" and len(calls) == 1
        call = {"id": calls[0]["id"], "type": "function", "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}  # fmt: skip
    else:
        out = chat(client, messages=messages, tools=TOOLS, tool_choice=named)
        assert out.choices[0].finish_reason == "tool_calls"
        checked_calls(out.choices[0].message, {"get_weather"})
        call = out.choices[0].message.tool_calls[0].model_dump()
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees, sunny"},
    ]
    answer = chat(client, messages=messages, tools=TOOLS, tool_choice="none", max_completion_tokens=8, stream_options={"include_usage": True} if stream else None, stream=stream)  # fmt: skip
    if stream:
        chunks = list(answer)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return messages, chunks[-1].usage.prompt_tokens, text
    return messages, answer.usage.prompt_tokens, answer.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip(
    client: openai.OpenAI,
    native_client: openai.OpenAI,
    model_dir: Path,
    tokenizer: Tokenizer,
    stream: bool,
) -> None:
    """Both gateways (Hermes prompt, template with tools) render the conversation as
    transformers renders it with the Qwen2.5-style template: same prompt tokens, same text."""
    messages, prompt_tokens, text = round_trip(client, stream)
    expected = hf_render(model_dir, messages, tools=TOOLS)
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in expected
    assert prompt_tokens == len(tokenizer.encode(expected))
    assert round_trip(native_client, stream)[1:] == (prompt_tokens, text)


def test_auto_and_none(client: openai.OpenAI) -> None:
    """`auto`: the model may answer or call (the random model answers); `none`: no calls."""
    for choice in ("auto", "none"):
        out = chat(client, n=2, tools=TOOLS, tool_choice=choice, max_completion_tokens=16)
        for c in out.choices:
            assert c.finish_reason in ("stop", "length", "tool_calls") and c.message.content
            if choice == "none":  # the text is not read for calls
                assert not c.message.tool_calls and c.finish_reason != "tool_calls", c
            elif c.message.tool_calls:
                checked_calls(c.message, {"get_weather", "get_time"})


# --- libraries ----------------------------------------------------------------------------


def test_instructor(gateway: str) -> None:
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(
            openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0), mode=mode
        )
        forecast = patched.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_model=Forecast, max_retries=0,
            extra_body=COMPACT if mode == instructor.Mode.JSON_SCHEMA else None, **SEEDED,
        )  # fmt: skip
        assert isinstance(forecast, Forecast), mode
        jsonschema.validate(forecast.model_dump(), FORECAST)


def test_langchain_with_structured_output(gateway: str) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    method: Literal["json_schema", "function_calling"]
    for method in ("json_schema", "function_calling"):
        llm = ChatOpenAI(
            model=MODEL, base_url=f"{gateway}/v1", api_key=SecretStr("unused"), temperature=1.0, seed=11,
            max_completion_tokens=200, max_retries=0,
            extra_body=COMPACT if method == "json_schema" else None,
        )  # fmt: skip
        structured = llm.with_structured_output(Forecast, method=method)
        forecast = structured.invoke("The weather in Paris?")
        assert isinstance(forecast, Forecast), method
        jsonschema.validate(forecast.model_dump(), FORECAST)
