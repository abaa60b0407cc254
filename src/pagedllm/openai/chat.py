"""The model's chat template, rendered in the gateway with jinja2 as `transformers` does.

The template comes from `--chat-template FILE`, else the model directory's
`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates: `default` is used); a request may bring its own (`chat_fields`). It is
rendered with `add_generation_prompt` (default true), the config's `bos_token` / `eos_token`
and the request's `chat_template_kwargs` / `documents`; with `continue_final_message` the text
ends right after the last message's content, as `transformers` cuts it (the model continues
that message). The gateway sends the resulting text to the `ensemble`,
whose `tokenizer` model encodes it with special tokens added. `transformers` encodes a
rendered chat without adding them, so when the tokenizer adds special tokens itself (a Llama
BOS) and the text starts with that BOS, the gateway drops it from the text: the model sees
one BOS, not two. A template that uses a `tools` variable (`accepts_tools`) gets the request's
tools as `apply_chat_template(tools=...)` passes them; `tools` says what the others get.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedllm.text.tokenizer import Tokenizer

# put after the final message's content for `continue_final_message`, to find where it ends
_CONTINUE = "<|pagedllm: the final message continues here|> "


class ChatTemplateError(ValueError):
    """The template refused the messages (e.g. `raise_exception` in the template)."""


def _token_text(value: Any) -> str:
    # special tokens are saved either as strings or as AddedToken dicts
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(
        self, source: str, bos_token: str = "", eos_token: str = "", strip_bos: bool = False
    ):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.template = env.from_string(source)
        # the template renders tools itself (`apply_chat_template(tools=...)`'s variable)
        self.accepts_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.strip_bos = strip_bos and bool(bos_token)

    def with_source(self, source: str) -> ChatTemplate:
        """Another template (a request's) with this one's special tokens."""
        return ChatTemplate(source, self.bos_token, self.eos_token, self.strip_bos)

    @staticmethod
    def from_model_dir(
        model_dir: str | Path, tokenizer: Tokenizer, override: str | Path | None = None
    ) -> ChatTemplate | None:
        """The model's template, or None if it has none."""
        source, cfg = _source(Path(model_dir), override)
        if not isinstance(source, str) or not source:
            return None
        # a tokenizer that adds special tokens to any text adds them to the rendered chat too
        adds_specials = bool(tokenizer.encode(""))
        return ChatTemplate(
            source,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            strip_bos=adds_specials,
        )

    @staticmethod
    def special_tokens_of(model_dir: str | Path, tokenizer: Tokenizer) -> ChatTemplate:
        """An empty template with the model's special tokens: `with_source` makes a request's
        template from it when the model has none of its own."""
        _, cfg = _source(Path(model_dir), None)
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        return ChatTemplate("", bos, eos, bool(tokenizer.encode("")))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`: ending with the assistant's turn opened
        (`add_generation_prompt`), or right after the last message's content
        (`continue_final_message`); `tools` (OpenAI's tool definitions) as `transformers`
        passes them (None when there are none); `variables`: more template variables (a
        request's `chat_template_kwargs`, `documents`)."""
        final = messages[-1].get("content") if continue_final_message else ""
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message needs a final message with text")
        if continue_final_message:  # a marker after the final message's content: see the cut
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE}]
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **(variables or {})}
        context |= {"messages": messages, "tools": tools}
        try:
            text = self.template.render(context, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        if continue_final_message:
            text = _cut_after_final(text, final)
        if self.strip_bos and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def _source(path: Path, override: str | Path | None) -> tuple[Any, dict[str, Any]]:
    """The template's source (None: none) and tokenizer_config.json."""
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    if override is not None:
        source: Any = Path(override).read_text()
    elif (path / "chat_template.jinja").exists():
        source = (path / "chat_template.jinja").read_text()
    else:
        source = cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source, cfg


def _cut_after_final(text: str, final: str) -> str:
    """`text` cut where the final message's content ends: before the marker put after it. If
    the template kept the marker's trailing space it keeps spacing, and the cut is exact;
    else it trimmed the content, and so is the cut (`transformers`' rule)."""
    if final.strip() not in text or _CONTINUE.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template"
        )
    at = text.rindex(_CONTINUE.strip())
    return text[:at] if text[at : at + len(_CONTINUE)] == _CONTINUE else text[:at].rstrip()
