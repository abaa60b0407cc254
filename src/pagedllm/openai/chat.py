"""The model's chat template, rendered in the gateway with jinja2 as `transformers` does.

The template comes from `--chat-template FILE`, else the model directory's
`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates: `default` is used). It is rendered with `add_generation_prompt=True` and the
config's `bos_token` / `eos_token`; the gateway sends the resulting text to the `ensemble`,
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

    @staticmethod
    def from_model_dir(
        model_dir: str | Path, tokenizer: Tokenizer, override: str | Path | None = None
    ) -> ChatTemplate | None:
        """The model's template, or None if it has none."""
        path = Path(model_dir)
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

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opened; `tools`
        (OpenAI's tool definitions) as `transformers` passes them (None when there are none)."""
        try:
            text = self.template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        if self.strip_bos and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text
