"""vLLM's chat-template fields through `pagedllm openai` (test_openai's real tritonserver and
gateway, tiny llama fp32): `add_generation_prompt`, `continue_final_message`, `echo`,
`chat_template_kwargs`, `documents` and a request's own `chat_template` (in a gateway that
trusts them: the app in process, in front of the same server). The oracle of every rendered
prompt is transformers' `apply_chat_template` (the ids the gateway sent, `return_token_ids`);
of the outputs, HF greedy on those ids."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import test_openai
from starlette.testclient import TestClient
from test_openai import MESSAGES, MODEL

from conftest import hf_greedy, hf_model
from pagedllm.openai.app import GatewayConfig, create_app
from pagedllm.openai.chat import ChatTemplate
from pagedllm.serving.tritonserver import TritonServer
from pagedllm.text.tokenizer import Tokenizer

model_dir, server, gateway = test_openai.model_dir, test_openai.server, test_openai.gateway
client, tokenizer = test_openai.client, test_openai.tokenizer

GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True, "max_tokens": 5}
PREFILL = "Paged attention"
CONTINUED = [*MESSAGES, {"role": "assistant", "content": PREFILL}]
# a template using variables beyond messages: enable_thinking and documents
THINKING = (
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
    "{% for d in documents or [] %}<s>document\n{{ d.title }}: {{ d.text }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n"
    "{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
DOCUMENTS = [{"title": "Paging", "text": "Keys and values live in blocks."}]


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return hf_model(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def trusting(server: TritonServer, model_dir: Path) -> Iterator[TestClient]:
    """The gateway in process, trusting requests' own chat templates, before the real server."""
    config = GatewayConfig(
        triton_url=server.grpc_url, model_dir=str(model_dir), trust_request_chat_template=True
    )
    with TestClient(create_app(config)) as http:
        yield http


def chat(http: Any, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def hf_ids(hf_tokenizer: Any, tokenizer: Tokenizer, messages: list[Any], **kwargs: Any) -> Any:
    """The ids of transformers' rendering, encoded as the server encodes a prompt."""
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text)


def content_of(out: dict[str, Any]) -> str:
    return str(out["choices"][0]["message"]["content"])


def test_add_generation_prompt_false(
    gateway: str, hf: Any, hf_tokenizer: Any, tokenizer: Tokenizer
) -> None:
    http = httpx.Client(base_url=gateway, timeout=60)
    out = chat(http, messages=MESSAGES, add_generation_prompt=False, **GREEDY)
    ids = hf_ids(hf_tokenizer, tokenizer, MESSAGES, add_generation_prompt=False)
    assert out["prompt_token_ids"] == ids
    assert out["choices"][0]["token_ids"] == hf_greedy(hf, [ids], 5, eos=None)[0]
    # the answer goes on in the last message's turn: its role is that message's (vLLM's)
    assert out["choices"][0]["message"]["role"] == "user"


@pytest.mark.parametrize("stream", [False, True])
def test_continue_final_message_with_echo(
    gateway: str, hf: Any, hf_tokenizer: Any, tokenizer: Tokenizer, stream: bool
) -> None:
    """The assistant's prefill continued (the prompt ends inside its turn, as transformers
    cuts it); echo puts the prefill before the answer, streamed in a chunk of its own."""
    http = httpx.Client(base_url=gateway, timeout=60)
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True}
    plain = chat(http, **body, **GREEDY)
    ids = hf_ids(hf_tokenizer, tokenizer, CONTINUED, continue_final_message=True)
    assert plain["prompt_token_ids"] == ids
    assert plain["choices"][0]["token_ids"] == hf_greedy(hf, [ids], 5, eos=None)[0]
    assert plain["choices"][0]["message"]["role"] == "assistant"
    if not stream:
        assert content_of(chat(http, **body, echo=True, **GREEDY)) == PREFILL + content_of(plain)
        return
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "stream": True, "echo": True, **body, **GREEDY},
    ) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(line)["choices"][0]["delta"] for line in lines]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": PREFILL}
    assert "".join(d.get("content", "") for d in deltas) == PREFILL + content_of(plain)


def test_echo_needs_the_answers_role(client: openai.OpenAI) -> None:
    """The last message is the user's, the answer the assistant's: nothing to echo."""
    kwargs = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 5}
    plain = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    echoed = client.chat.completions.create(**kwargs, extra_body={"echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_continue_final_message_cut_as_transformers(
    model_dir: Path, tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    """Trailing whitespace the template keeps is kept; one it trims is not added back."""
    template = ChatTemplate.from_model_dir(model_dir, tokenizer)
    assert template is not None
    for prefill in (PREFILL, PREFILL + " ", " " + PREFILL + "\n"):
        messages = [*MESSAGES, {"role": "assistant", "content": prefill}]
        ours = template.render(messages, add_generation_prompt=False, continue_final_message=True)
        theirs = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, continue_final_message=True
        )
        assert ours == theirs


def test_template_kwargs_and_documents(
    trusting: TestClient, hf: Any, hf_tokenizer: Any, tokenizer: Tokenizer
) -> None:
    """A request's own template gets chat_template_kwargs and documents, as transformers
    passes them; the documents may come in either place."""
    expected = hf_ids(
        hf_tokenizer,
        tokenizer,
        MESSAGES,
        chat_template=THINKING,
        add_generation_prompt=True,
        documents=DOCUMENTS,
        enable_thinking=True,
    )
    kwargs = {"enable_thinking": True}
    for fields in (
        {"chat_template_kwargs": kwargs, "documents": DOCUMENTS},
        {"chat_template_kwargs": {**kwargs, "documents": DOCUMENTS}},
    ):
        out = chat(trusting, messages=MESSAGES, chat_template=THINKING, **fields, **GREEDY)
        assert out["prompt_token_ids"] == expected
        assert out["choices"][0]["token_ids"] == hf_greedy(hf, [expected], 5, eos=None)[0]
    # the model's template with the variable: used where the template reads it, else unused
    out = chat(trusting, messages=MESSAGES, chat_template_kwargs={"enable_thinking": False})
    assert out["prompt_token_ids"] == hf_ids(
        hf_tokenizer, tokenizer, MESSAGES, add_generation_prompt=True
    )
    bad = trusting.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "chat_template": "{% for %}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"chat_template": "{{ messages }}"}, "chat_template", "does not trust them"),
        (
            {"continue_final_message": True},
            "continue_final_message",
            "Cannot set both continue_final_message and add_generation_prompt",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "may not"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "may not"),
        (
            {"documents": DOCUMENTS, "chat_template_kwargs": {"documents": DOCUMENTS}},
            "documents",
            "given twice",
        ),
        ({"add_generation_prompt": "maybe"}, "add_generation_prompt", "valid boolean"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
             "add_generation_prompt": False, "chat_template": None},
            None,
            None,
        ),
    ],
)  # fmt: skip
def test_refused_with_the_field_named(
    gateway: str, fields: dict[str, Any], param: str | None, message: str | None
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    if param is None:  # the final message continued is the user's: accepted, as vLLM does
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
