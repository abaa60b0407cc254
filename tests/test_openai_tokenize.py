"""vLLM's `/tokenize` and `/detokenize` through `pagedllm openai` (test_openai's real
tritonserver and gateway, tiny llama), and through the app in process over a copy of the
checkpoint whose tokenizer adds a BOS (so that `add_special_tokens` matters) and which trusts
requests' own chat templates. The oracle is the checkpoint's own HF tokenizer: `encode` with
and without special tokens, `apply_chat_template(tokenize=True)` with the request's kwargs,
`convert_ids_to_tokens`, `decode`; and the prompt ids chat completions send (the count is
what the model sees)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_openai
from starlette.testclient import TestClient
from test_openai import MESSAGES, MODEL, PROMPT

from pagedllm.openai.app import GatewayConfig, create_app
from pagedllm.serving.tritonserver import TritonServer

model_dir, server, gateway = test_openai.model_dir, test_openai.server, test_openai.gateway

BOS = 0  # the tiny tokenizer's <s>
VOCAB = 368  # the tiny tokenizer's ids (config.json's vocab_size is 384: rows without a token)
CONVERSATION = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Nice to meet you!"},
    {"role": "user", "content": "Can I ask a question?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# a template that renders tools and a chat_template_kwargs variable itself
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<s>tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</s>\n{% endif %}{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def bos_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint, its tokenizer adding <s> to every text (as Llama's does)."""
    path = tmp_path_factory.mktemp("bos") / MODEL
    shutil.copytree(model_dir, path)
    tok = json.loads((path / "tokenizer.json").read_text())
    bos, text = (
        {"SpecialToken": {"id": "<s>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
    )
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, text],
        "pair": [bos, text, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


@pytest.fixture(scope="module")
def hf(bos_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(bos_dir))


@pytest.fixture(scope="module")
def app(server: TritonServer, bos_dir: Path) -> Iterator[TestClient]:
    """The gateway in process over `bos_dir`, trusting requests' templates (Triton is asked
    only for max_model_len)."""
    config = GatewayConfig(
        triton_url=server.grpc_url, model_dir=str(bos_dir), trust_request_chat_template=True
    )
    with TestClient(create_app(config)) as http:
        yield http


@pytest.fixture(scope="module")
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def max_model_len(http: httpx.Client) -> int:
    """What /v1/models reports."""
    return int(http.get(f"/v1/models/{MODEL}").json()["max_model_len"])


def tokenize(client: Any, **body: Any) -> dict[str, Any]:
    r = client.post("/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def refused(client: Any, path: str, body: dict[str, Any], status: int = 400) -> dict[str, Any]:
    # ASCII-escaped JSON: a lone surrogate travels as JSON's \ud800
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    return dict(r.json()["error"])


# --- the completion form ----------------------------------------------------------------------


def test_tokenize_prompt(app: TestClient, hf: Any, max_model_len: int) -> None:
    for add_special in (False, True):
        ids = hf.encode(PROMPT, add_special_tokens=add_special)
        assert (ids[0] == BOS) == add_special
        out = tokenize(app, prompt=PROMPT, add_special_tokens=add_special)
        assert out == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                       "token_strs": None}  # fmt: skip
    # the default adds them, as vLLM's; model may be left out
    r = app.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
    ids = hf.encode(PROMPT)
    assert r.json()["tokens"] == ids
    assert r.json()["token_strs"] == hf.convert_ids_to_tokens(ids)


def test_tokenize_through_the_served_gateway(
    http: httpx.Client, model_dir: Path, max_model_len: int
) -> None:
    """The subprocess gateway over the served checkpoint (its tokenizer adds nothing)."""
    import transformers

    plain = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    text = "Paged attention stores keys and values in blocks. \u00e9t\u00e9 \U0001f600"
    out = tokenize(http, prompt=text, return_token_strs=True)
    assert out["tokens"] == plain.encode(text) and out["count"] == len(out["tokens"])
    assert out["token_strs"] == plain.convert_ids_to_tokens(out["tokens"])
    assert out["max_model_len"] == max_model_len
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": text}


# --- the chat form ----------------------------------------------------------------------------


def test_tokenize_chat_as_transformers(app: TestClient, hf: Any) -> None:
    """Every combination of the flags (vLLM's test): the rendered chat encoded with special
    tokens added only when asked; by default, apply_chat_template(tokenize=True)."""
    for add_generation in (False, True):
        for continue_final in (False, True):
            if add_generation and continue_final:
                continue
            messages = CONVERSATION + [{"role": "assistant", "content": "Sure,"}] * continue_final
            flags = {"add_generation_prompt": add_generation,
                     "continue_final_message": continue_final}  # fmt: skip
            text = hf.apply_chat_template(messages, tokenize=False, **flags)
            for add_special in (False, True):
                ids = hf.encode(text, add_special_tokens=add_special)
                out = tokenize(app, messages=messages, add_special_tokens=add_special, **flags)
                assert out["tokens"] == ids and out["count"] == len(ids)
                assert out["token_strs"] is None
            # the template's BOS and no other: what transformers gives
            theirs = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **flags)
            assert tokenize(app, messages=messages, **flags)["tokens"] == theirs
            assert theirs[0] == BOS and theirs[1] != BOS
    # and the ids a chat completion sends the model: one BOS, the template's
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 1, "return_token_ids": True}
    sent = app.post("/v1/chat/completions", json=body).json()["prompt_token_ids"]
    assert tokenize(app, messages=CONVERSATION)["tokens"] == sent


def test_tokenize_chat_counts_what_chat_completions_send(http: httpx.Client) -> None:
    """The served gateway: the chat form's ids are the prompt ids of a chat completion, tools
    included (on a template that does not render them: Hermes' prompt, as chat completions)."""
    counts = []
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}
        sent = http.post("/v1/chat/completions", json={**body, **extra})
        assert sent.status_code == 200, sent.text
        out = tokenize(http, messages=MESSAGES, tools=extra.get("tools"), return_token_strs=True)
        assert out["tokens"] == sent.json()["prompt_token_ids"]
        assert len(out["token_strs"]) == out["count"]
        counts.append(out["count"])
    assert counts[1] > counts[0] + 20


def test_tokenize_chat_tools_and_kwargs(app: TestClient, hf: Any) -> None:
    """A request's own template gets the tools and chat_template_kwargs as transformers
    passes them; return_token_strs spells the ids."""
    seen = []
    for kwargs in ({}, {"enable_thinking": True}):
        theirs = hf.apply_chat_template(
            CONVERSATION, tools=TOOLS, chat_template=TOOLS_TEMPLATE, tokenize=True,
            add_generation_prompt=True, return_dict=False, **kwargs,
        )  # fmt: skip
        out = tokenize(
            app,
            messages=CONVERSATION,
            tools=TOOLS,
            chat_template=TOOLS_TEMPLATE,
            chat_template_kwargs=kwargs,
            return_token_strs=True,
        )
        assert out["tokens"] == theirs
        assert out["token_strs"] == hf.convert_ids_to_tokens(theirs)
        seen.append(theirs)
    assert seen[0] != seen[1]  # the variable is used
    assert hf.decode(seen[0]).startswith("<s><s>tools\n{")  # the tools are rendered


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message",
         "Cannot set both"),
        ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
         "continue_final_message", "Cannot set both"),
        ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template",
         "does not trust them"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs.tokenize", "may not"),
        ({"messages": MESSAGES, "tools": TOOLS * 2}, "tools[1].function.name", "two tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}],
          "add_generation_prompt": True}, "messages[0].content[0]", "only text"),
        ({"messages": MESSAGES, "echo": True}, "echo", "chat completions field"),
        ({"messages": MESSAGES, "prompt": PROMPT}, "prompt", "not both"),
        ({"prompt": PROMPT, "add_generation_prompt": True}, "add_generation_prompt",
         "Unrecognized request argument"),
        ({"prompt": PROMPT, "add_special_tokens": "maybe"}, "add_special_tokens", "boolean"),
        ({"prompt": ["a", "b"]}, "prompt", "valid string"),
        ({}, "prompt", "Missing required parameter"),
        ({"prompt": "\ud800"}, "prompt", "lone surrogate"),
        ({"prompt": "the quick fox " * 250}, "prompt", "context length is only"),
    ],
)  # fmt: skip
def test_tokenize_refusals(
    http: httpx.Client, body: dict[str, Any], param: str, message: str
) -> None:
    error = refused(http, "/tokenize", {"model": MODEL, **body})
    assert error["param"] == param and message in error["message"], error


def test_model_and_paths(http: httpx.Client) -> None:
    """An unknown model is 404 as on the other routes; the routes are vLLM's, at the root."""
    for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [5]})):
        error = refused(http, path, {"model": "gpt-4", **body}, 404)
        assert error["code"] == 404 and error["param"] == "model"
        assert http.post(f"/v1{path}", json=body).status_code == 404
        assert http.get(path).status_code == 405


# --- /detokenize ------------------------------------------------------------------------------


def test_detokenize(app: TestClient, hf: Any) -> None:
    text = "This is a test prompt."
    ids = hf.encode(text, add_special_tokens=False)
    assert app.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": text}
    # special tokens are kept (transformers' decode); no tokens: no text
    with_bos = hf.encode(text)
    out = app.post("/detokenize", json={"tokens": with_bos}).json()
    assert out["prompt"] == hf.decode(with_bos) and out["prompt"].startswith("<s>")
    assert app.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    # a round trip through both
    out = tokenize(app, messages=CONVERSATION)
    text = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert app.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"] == text


def test_detokenize_refusals(http: httpx.Client, max_model_len: int) -> None:
    error = refused(http, "/detokenize", {"tokens": [5, VOCAB, -1, 7, 10**6]})
    assert error["param"] == "tokens[1]"
    assert f"{VOCAB}, -1, 1000000 are outside the vocabulary" in error["message"]
    assert f"from 0 to {VOCAB - 1}" in error["message"]
    error = refused(http, "/detokenize", {"tokens": [3, 4, 999]})
    assert error["param"] == "tokens[2]" and "999 is outside" in error["message"]
    many = refused(http, "/detokenize", {"tokens": list(range(VOCAB, VOCAB + 15))})
    assert "and 5 more" in many["message"]
    for tokens, param in (([1, "2"], "tokens[1]"), ([True], "tokens[0]"), ("1 2", "tokens")):
        assert refused(http, "/detokenize", {"tokens": tokens})["param"] == param
    assert refused(http, "/detokenize", {})["param"] == "tokens"
    long = refused(http, "/detokenize", {"tokens": [5] * (max_model_len + 1)})
    assert long["param"] == "tokens" and "context length is only" in long["message"]
    assert http.post("/detokenize", json={"tokens": [5] * max_model_len}).status_code == 200
