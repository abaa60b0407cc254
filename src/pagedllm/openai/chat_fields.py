"""vLLM's chat-template fields of `/v1/chat/completions` (`extra_body` in the `openai` client):

- `add_generation_prompt` (default true): the template opens the assistant's turn;
- `continue_final_message`: the prompt ends right after the last message's content, so the
  model continues it (an assistant "prefill"); not together with `add_generation_prompt`;
- `chat_template_kwargs`: more template variables (`enable_thinking`, `documents`, ...);
  `chat_template` and `tokenize` are refused as vLLM refuses them, and the variables the
  request sets by its own fields (`messages`, `tools`, `add_generation_prompt`,
  `continue_final_message`) too;
- `documents`: the template's `documents` (retrieval-augmented templates);
- `chat_template`: this request's own template, refused unless the gateway trusts them
  (`GatewayConfig.trust_request_chat_template`, vLLM's `--trust-request-chat-template`);
- `echo`: the answer's content starts with the last message's, when that message has the
  answer's role (vLLM's rule).
"""

from __future__ import annotations

from typing import Any

from pagedllm.openai.chat import ChatTemplate, ChatTemplateError
from pagedllm.openai.errors import bad_request
from pagedllm.openai.structured import Strict

# template variables a request sets through its own fields (vLLM refuses the first two)
RESERVED_KWARGS = (
    "chat_template",
    "tokenize",
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
)


class ChatTemplateFields(Strict):
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    echo: bool = False

    def check_chat_template_fields(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "Cannot set both continue_final_message and add_generation_prompt to true "
                "(send add_generation_prompt: false)",
                "continue_final_message",
            )
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_KWARGS:
                param = f"chat_template_kwargs.{key}"
                field = "" if key in ("chat_template", "tokenize") else f" (use the {key} field)"
                raise bad_request(f"{param} may not be set{field}", param)
        if self.documents is not None and "documents" in (self.chat_template_kwargs or {}):
            message = "documents is given twice: as a field and in chat_template_kwargs"
            raise bad_request(message, "documents")
        if self.chat_template is not None and not self.chat_template.strip():
            raise bad_request("chat_template must not be empty", "chat_template")

    def template_variables(self) -> dict[str, Any]:
        """The variables the template gets beyond messages, tools and the prompt flags."""
        variables = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            variables["documents"] = self.documents
        return variables

    def answer_role(self, messages: list[dict[str, Any]]) -> str:
        """The role of the answer: the assistant's, or without a generation prompt the last
        message's (the model goes on in that turn), as vLLM answers."""
        return "assistant" if self.add_generation_prompt else str(messages[-1]["role"])

    def echoed(self, messages: list[dict[str, Any]]) -> str | None:
        """With `echo`, the text the answer starts with: the last message's content when it
        has the answer's role ("" otherwise); None without echo."""
        if not self.echo:
            return None
        last = messages[-1]
        if last.get("role") != self.answer_role(messages):
            return ""
        content = last.get("content")
        return content if isinstance(content, str) else ""


def render_chat(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    definitions: list[dict[str, Any]] | None,
    body: ChatTemplateFields,
) -> str:
    """The request's messages (and tool definitions) through `template` with its chat fields;
    a template error is a 400 naming `messages`."""
    try:
        return template.render(
            messages,
            definitions,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            variables=body.template_variables(),
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
