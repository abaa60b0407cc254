"""OpenAI's request bodies, validated with pydantic.

Unknown fields are refused by name, as OpenAI does; fields that OpenAI has but the `ensemble`
cannot honour (`suffix`, ...) are refused with a 400 naming the field rather than ignored.
Structured outputs (`response_format`, vLLM's `structured_outputs` and `guided_*`) are resolved
by `structured`, tools by `tools`, chat-template fields by `chat_fields`, `logit_bias` and
vLLM's other extras (`prompt_logprobs`, `return_token_ids`, ...) by `vllm_fields`. vLLM's extra
sampling fields (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`) are
accepted, as vLLM's server does (`extra_body` in the `openai` client).
Log-probs go up to vLLM's 20 alternatives per token (OpenAI's completions stop at 5). A
completions `prompt` is a string, a list of strings, a list of token ids or a list of such
lists; a bad id answers 400 naming its position (`prompt[1][3]`). Every string that reaches
Triton must be encodable as UTF-8 (JSON's escapes can spell a lone surrogate), every float
finite, every integer within the engine's range (int32 counts, seeds below 2**63).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedllm.openai.chat_fields import ChatTemplateFields
from pagedllm.openai.errors import bad_request
from pagedllm.openai.router_fields import ChatRouterFields, RouterFields
from pagedllm.openai.structured import Strict, StructuredRequest
from pagedllm.openai.tools import MessageToolCall, Tool, ToolChoice
from pagedllm.openai.vllm_fields import INT32_MAX, MAX_LOGPROBS, VllmFields

# more samples than this per request are refused (each is its own Triton request)
MAX_N = 16
MAX_SEED = 2**63  # the engine's seeds are in [0, 2**63)
_SURROGATE = re.compile("[\ud800-\udfff]")
# a prompt: its text, or its token ids
Prompt = str | list[int]


def check_utf8(value: Any, param: str) -> None:
    """A 400 naming `param` (down to the index or key) for a string in `value` that cannot be
    encoded as UTF-8: a lone surrogate, which JSON's \\uXXXX escapes can spell."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found:
            raise bad_request(
                f"{param} is not valid Unicode: a lone surrogate ({ascii(found.group())[1:-1]}) "
                f"at position {found.start()} cannot be encoded as UTF-8",
                param,
            )
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_utf8(item, f"{param}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_utf8(key, param)
            check_utf8(item, f"{param}.{key}")


class StreamOptions(Strict):
    include_usage: bool | None = None  # None: false, unless continuous_usage_stats
    # vLLM's: usage on every chunk too
    continuous_usage_stats: bool = False

    def check(self) -> None:
        if self.continuous_usage_stats and self.include_usage is False:
            message = "continuous_usage_stats needs include_usage (not false)"
            raise bad_request(message, "stream_options.continuous_usage_stats")


class _SamplingRequest(StructuredRequest, RouterFields, VllmFields):
    """The fields completions and chat completions share (with the structured-output fields:
    `response_format`, vLLM's `structured_outputs` and `guided_*`; those SGLang-family routers
    add, `router_fields`; `logit_bias` and vLLM's extras, `vllm_fields`)."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None  # accepted and ignored
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    ignore_eos: bool | None = None

    def check(self) -> None:
        """Cross-field checks pydantic's per-field constraints cannot express."""
        self.check_structured()
        self.check_vllm_fields(self.stream)
        self.check_router_fields()
        if self.constraint is not None:
            check_utf8(self.constraint.spec, self.constraint.param)
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.stream_options is not None:
            self.stream_options.check()
        check_utf8(self.stop, "stop")
        if self.seed is not None and self.seed + self.n - 1 >= MAX_SEED:
            raise bad_request(f"seed + n - 1 must be below 2**63, got {self.seed}", "seed")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4:
            raise bad_request(f"at most 4 stop sequences, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise bad_request("stop sequences must not be empty", "stop")

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        """The engine's `sampling_parameters` (vLLM names) for one sample, without its seed."""
        values: dict[str, Any] = {"max_tokens": max_tokens}
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "skip_special_tokens",
        ):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if self.stop:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return values

    @property
    def include_usage(self) -> bool:
        """A last chunk with the usage (and "usage": null on the others)."""
        options = self.stream_options
        return options is not None and bool(options.include_usage or self.continuous_usage)

    @property
    def continuous_usage(self) -> bool:
        """The usage so far on every chunk (vLLM's `continuous_usage_stats`)."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


MAX_BEAM_WIDTH = 10  # the engine's (2 x width log-probs each, at most 20)


def check_beam_search(body: CompletionRequest) -> None:
    """What vLLM's beam search (`openai.beams`) takes on /v1/completions and ours does not:
    400 naming it."""
    if not 1 <= body.n <= MAX_BEAM_WIDTH:
        raise bad_request(f"use_beam_search: n (the beam width) must be 1-{MAX_BEAM_WIDTH}", "n")
    refused = {
        "logprobs": body.logprobs is not None,
        "stop": bool(body.stop),
        "prompt_logprobs": body.prompt_logprobs is not None,
        "logit_bias": bool(body.logit_bias),
        "allowed_token_ids": body.allowed_token_ids is not None,
        "min_tokens": bool(body.min_tokens),
    }
    if body.constraint is not None:
        refused[body.constraint.param] = True
    for param, sent in refused.items():
        if sent:
            raise bad_request(f"use_beam_search cannot be combined with {param}", param)


class CompletionRequest(_SamplingRequest):
    # a string, a list of strings, a list of token ids or a list of such lists (`prompts`)
    prompt: str | list[Any]
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's beam search (`openai.beams`): the choices are the `n` best beams
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)

    def check(self) -> None:
        super().check()
        check_utf8(self.prompt, "prompt")
        if self.use_beam_search:
            check_beam_search(self)
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (no server-side ranking)", "best_of")

    def prompts(self, vocab_size: int) -> list[Prompt]:
        """The prompts, each a string or a list of token ids (in [0, vocab_size)); 400 naming
        the position of the first bad one."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise bad_request("prompt must not be empty", "prompt")
        first = self.prompt[0]
        if isinstance(first, str):
            for i, item in enumerate(self.prompt):
                if not isinstance(item, str):
                    raise bad_request(
                        f"prompt[{i}] must be a string, as prompt[0] is", f"prompt[{i}]"
                    )
            return list(self.prompt)
        if not isinstance(first, list):  # one prompt of token ids
            return [_token_ids(self.prompt, "prompt", vocab_size)]
        prompts: list[Prompt] = []
        for i, item in enumerate(self.prompt):
            if not isinstance(item, list):
                message = f"prompt[{i}] must be a list of token ids, as prompt[0] is"
                raise bad_request(message, f"prompt[{i}]")
            prompts.append(_token_ids(item, f"prompt[{i}]", vocab_size))
        return prompts


def _token_ids(values: list[Any], param: str, vocab_size: int) -> list[int]:
    """`values` as token ids: integers (not booleans) in [0, vocab_size)."""
    if not values:
        raise bad_request(f"{param} must not be empty", param)
    for k, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            shown = json.dumps(value, ensure_ascii=False)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise bad_request(
                f"{param}[{k}]: {shown} is not a token id (an integer from 0 to {vocab_size - 1})",
                f"{param}[{k}]",
            )
    return list(values)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # other keys (name, tool_call_id, ...) are passed to the chat template as they are
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result answers this call

    def text(self, index: int) -> str | None:
        """The content as one string (text parts joined); other parts are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"only text content parts are supported, got type {part.get('type')!r}",
                    f"messages[{index}].content[{j}]",
                )
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingRequest, ChatRouterFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        self.check_chat_template_fields()
        for name in ("chat_template", "chat_template_kwargs", "documents"):
            check_utf8(getattr(self, name), name)
        check_utf8([t.model_dump() for t in self.tools or []], "tools")
        for i, message in enumerate(self.messages):
            check_utf8(message.model_dump(exclude_none=True), f"messages[{i}]")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens; None: up to the context."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def parse_body(model: type[_SamplingRequest], raw: Any) -> Any:
    """Validate a decoded JSON body; APIError 400 naming the first failing field."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param_name(first["loc"])
        if first["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param) from None
        if first["type"] == "missing":
            raise bad_request(f"Missing required parameter: {param}", param) from None
        if first["type"] == "finite_number":
            message = f"{param} must be a finite number (not NaN or infinity)"
            raise bad_request(message, param) from None
        message = f"{param}: {first['msg']}"
        valid = _valid_range(model, first["loc"])
        if valid is not None:
            message += f"; valid range {valid}"
        raise bad_request(message, param) from None
    request.check()
    return request


def _valid_range(model: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    """A top-level numeric field's bounds as an interval, e.g. '[1, 2147483647]'."""
    field = model.model_fields.get(str(loc[0])) if loc else None
    bounds = {
        name: getattr(bound, name)
        for bound in (field.metadata if field else [])
        for name in ("ge", "gt", "le", "lt")
        if getattr(bound, name, None) is not None
    }
    if not bounds:
        return None
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds.get('gt', '-inf')}"
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds.get('lt', 'inf')})"
    return f"{low}, {high}"


def _param_name(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; union branches (pydantic adds the
    tried type's name, e.g. 'str' or 'list[str]') are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in {"str", "int", "float", "bool", "dict"}:
            continue
        else:
            out += f".{part}" if out else part
    return out


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them: dicts with string content."""
    out = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        text = message.text(i)
        item["content"] = "" if text is None else text
        out.append(item)
    return out
