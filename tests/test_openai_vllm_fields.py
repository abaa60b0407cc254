"""vLLM's extra fields through `pagedllm openai` (test_openai's real tritonserver and gateway,
tiny llama fp32), with the official `openai` client and raw HTTP: prompt log-probs against HF
transformers' log_softmax (1e-3), token ids against the tokenizer and HF greedy, the usage
(continuous, cached prompt tokens), truncation, the model card, logit_bias /
allowed_token_ids (also through Triton's `sampling_parameters` directly), and a 400 naming the
field for every bad value."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import test_openai
import torch
from test_contract import generate
from test_openai import MESSAGES, MODEL, PROMPT, rendered_chat

from conftest import TINY, hf_greedy, hf_model
from pagedllm.serving.tritonserver import TritonServer
from pagedllm.text.tokenizer import Tokenizer

model_dir, server, gateway = test_openai.model_dir, test_openai.server, test_openai.gateway
client, tokenizer = test_openai.client, test_openai.tokenizer

TOL = 1e-3
V = TINY["vocab_size"]
GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return hf_model(model_dir)


def post(gateway: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/{path}", json={"model": MODEL, **body}, timeout=60)


def events(gateway: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of a streamed answer's events, [DONE] left out."""
    out = []
    with httpx.stream(
        "POST", f"{gateway}/v1/{path}", json={"model": MODEL, "stream": True, **body}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def refused(gateway: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The error of a request answered 400."""
    r = post(gateway, path, body)
    assert r.status_code == 400, r.text
    return dict(r.json()["error"])


def hf_rows(hf: Any, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float64 log_softmax: row j scores the token at position j + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)


def check_prompt_logprobs(
    got: list[Any], ids: list[int], hf: Any, tokenizer: Tokenizer, n: int
) -> None:
    """vLLM's shape: null, then per token {id: {logprob, rank, decoded_token}}, the prompt's
    token first, then the n best with ranks 1..n; values and ranks as HF's."""
    rows = hf_rows(hf, ids)
    assert len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
        row, token = rows[t - 1], ids[t]
        best = row.topk(n).indices.tolist()
        keys = [str(token)] + [str(i) for i in best if i != token]
        assert list(got[t]) == keys
        rank = int((row > row[token]).sum()) + 1
        expected = {token: rank} | {i: r for r, i in enumerate(best, start=1)}
        for key, entry in got[t].items():
            i = int(key)
            assert entry["logprob"] == pytest.approx(row[i].item(), abs=TOL)
            assert entry["rank"] == expected[i]
            assert entry["decoded_token"] == tokenizer.decode([i], False)


# --- prompt_logprobs --------------------------------------------------------------------------


def test_completion_prompt_logprobs_match_hf(gateway: str, hf: Any, tokenizer: Tokenizer) -> None:
    rng = random.Random(3)
    id_prompt = [rng.randrange(2, V) for _ in range(7)]
    body = {"prompt": [tokenizer.encode(PROMPT), id_prompt], "max_tokens": 2, **GREEDY}
    choices = post(gateway, "completions", {**body, "prompt_logprobs": 3}).json()["choices"]
    for choice, ids in zip(choices, body["prompt"], strict=True):
        check_prompt_logprobs(choice["prompt_logprobs"], ids, hf, tokenizer, 3)
    # none asked: each choice says null (as vLLM's), and so do the token-id fields
    plain = post(gateway, "completions", body).json()["choices"][0]
    assert plain["prompt_logprobs"] is None and plain["logprobs"] is None
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None
    # echo with logprobs asks for them too (vLLM's rule): the choice carries them
    echoed = post(gateway, "completions", {**body, "echo": True, "logprobs": 1}).json()
    check_prompt_logprobs(echoed["choices"][1]["prompt_logprobs"], id_prompt, hf, tokenizer, 1)


def test_chat_prompt_logprobs_match_hf(
    gateway: str, hf: Any, tokenizer: Tokenizer, model_dir: Path
) -> None:
    """The chat answer's own field (vLLM's place), over the rendered chat's ids."""
    body = {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 2, **GREEDY}
    out = post(gateway, "chat/completions", body).json()
    ids = tokenizer.encode(rendered_chat(model_dir, tokenizer))
    check_prompt_logprobs(out["prompt_logprobs"], ids, hf, tokenizer, 2)
    plain = post(gateway, "chat/completions", {**body, "prompt_logprobs": None}).json()
    assert plain["prompt_logprobs"] is None and plain["prompt_token_ids"] is None


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_prompt_logprobs_refusals(gateway: str, path: str) -> None:
    body = {"prompt": PROMPT} if path == "completions" else {"messages": MESSAGES}
    for value, message in ((21, "valid range [0, 20]"), (-1, "valid range [0, 20]")):
        error = refused(gateway, path, {**body, "prompt_logprobs": value})
        assert error["param"] == "prompt_logprobs" and message in error["message"]
    error = refused(gateway, path, {**body, "prompt_logprobs": 1, "stream": True})
    assert error["param"] == "prompt_logprobs" and "stream" in error["message"]


# --- return_token_ids, return_tokens_as_token_ids -----------------------------------------------


@pytest.mark.parametrize("prompt", [PROMPT, [5, 17, 42, 99]])
def test_completion_token_ids(gateway: str, hf: Any, tokenizer: Tokenizer, prompt: Any) -> None:
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    expected = hf_greedy(hf, [prompt_ids], 6, eos=None)[0]
    body = {"prompt": prompt, "max_tokens": 6, "return_token_ids": True, **GREEDY}
    choice = post(gateway, "completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == expected
    # streamed: each chunk its new ids, the first one the prompt's
    chunks = [e["choices"][0] for e in events(gateway, "completions", body)]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == expected
    # with logprobs and return_tokens_as_token_ids: tokens spelled token_id:N
    spelled = {**body, "logprobs": 2, "return_tokens_as_token_ids": True, "echo": True}
    logprobs = post(gateway, "completions", spelled).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in prompt_ids + expected]
    assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"][1:] for k in top)
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:k]) for k in range(len(lengths))]


def test_chat_token_ids(
    client: openai.OpenAI, gateway: str, hf: Any, tokenizer: Tokenizer, model_dir: Path
) -> None:
    prompt_ids = tokenizer.encode(rendered_chat(model_dir, tokenizer))
    expected = hf_greedy(hf, [prompt_ids], 5, eos=None)[0]
    extra = {"ignore_eos": True, "return_token_ids": True}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, extra_body=extra
    )
    assert out.model_extra is not None and out.model_extra["prompt_token_ids"] == prompt_ids
    assert out.choices[0].model_extra == {"token_ids": expected}
    body = {"messages": MESSAGES, "max_tokens": 5, "return_token_ids": True, **GREEDY}
    chunks = events(gateway, "chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt_ids  # the role chunk
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == expected
    # chat log-probs spelled token_id:N; bytes stay the token's own
    spelled = {**body, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    content = post(gateway, "chat/completions", spelled).json()["choices"][0]["logprobs"]
    assert [c["token"] for c in content["content"]] == [f"token_id:{t}" for t in expected]
    assert all(c["top_logprobs"][0]["token"].startswith("token_id:") for c in content["content"])


# --- usage: continuous, cached prompt tokens ------------------------------------------------


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_continuous_usage_stats(gateway: str, tokenizer: Tokenizer, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 5, "n": 2, "return_token_ids": True, **GREEDY}
    body |= {"prompt": PROMPT} if path == "completions" else {"messages": MESSAGES}
    stream = {"stream_options": {"continuous_usage_stats": True}}
    chunks = events(gateway, path, {**body, **stream})
    *per_choice, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert isinstance(last["usage"]["prompt_tokens_details"]["cached_tokens"], int)
    seen: dict[int, int] = {}
    for chunk in per_choice:
        choice, usage = chunk["choices"][0], chunk["usage"]
        seen[choice["index"]] = seen.get(choice["index"], 0) + len(choice.get("token_ids") or [])
        assert usage["completion_tokens"] == seen[choice["index"]]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"]
    assert seen == {0: 5, 1: 5}
    error = refused(gateway, path, {**body, "stream": True, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}})  # fmt: skip
    assert error["param"] == "stream_options.continuous_usage_stats"


@pytest.mark.parametrize("stream", [False, True])
def test_cached_prompt_tokens(client: openai.OpenAI, stream: bool) -> None:
    """A prompt seen before is served from the prefix cache in whole blocks of 16, its last
    token always computed: (L - 1) // 16 * 16 of L = 40."""
    prompt = [random.Random(10 + stream).randrange(2, V) for _ in range(40)]
    cached = []
    for _ in range(2):
        if stream:
            chunks = list(
                client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=2,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 32]


def test_triton_reports_cached_tokens_and_prompt_ranks(server: TritonServer) -> None:
    """The contract's outputs: num_cached_tokens on the last response; prompt_ranks with
    prompt log-probs."""
    ids = [random.Random(12).randrange(2, V) for _ in range(20)]
    sampling = {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    values = {"input_ids": np.array(ids, dtype=np.int32), "stream": True}
    values |= {"sampling_parameters": json.dumps(sampling)}
    responses = generate(server, values)
    assert len(responses[0]["prompt_ranks"]) == len(ids) - 1
    assert all(r >= 1 for r in responses[0]["prompt_ranks"])
    assert responses[-1]["num_cached_tokens"].tolist() == [0]  # prompt log-probs: no hits
    assert all("num_cached_tokens" not in r for r in responses[:-1])


# --- truncate_prompt_tokens, /v1/models -------------------------------------------------------


def test_truncate_prompt_tokens(gateway: str, hf: Any, tokenizer: Tokenizer) -> None:
    text = "Paged attention stores keys and values in fixed-size blocks."
    ids = tokenizer.encode(text)
    body = {"prompt": text, "max_tokens": 4, "return_token_ids": True}
    out = post(gateway, "completions", {**body, **GREEDY, "truncate_prompt_tokens": 5}).json()
    choice = out["choices"][0]
    assert out["usage"]["prompt_tokens"] == 5 and choice["prompt_token_ids"] == ids[-5:]
    assert choice["token_ids"] == hf_greedy(hf, [ids[-5:]], 4, eos=None)[0]
    whole = post(gateway, "completions", {**body, **GREEDY, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)  # -1: the model's context
    chat = {"messages": MESSAGES, "max_tokens": 1, "truncate_prompt_tokens": 4}
    assert post(gateway, "chat/completions", chat).json()["usage"]["prompt_tokens"] == 4
    for value, message in (
        (513, "truncate_prompt_tokens value (513) is greater than max_model_len (512)"),
        (-2, "valid range [-1,"),
        (0, "must be -1 (the model's context) or at least 1"),
    ):
        error = refused(gateway, "completions", {**body, "truncate_prompt_tokens": value})
        assert error["param"] == "truncate_prompt_tokens" and message in error["message"]


def test_model_card_as_vllm(gateway: str, model_dir: Path) -> None:
    listed = httpx.get(f"{gateway}/v1/models").json()["data"]
    card = httpx.get(f"{gateway}/v1/models/{MODEL}").json()
    assert len(listed) == 1 and listed[0]["id"] == card["id"] == MODEL
    assert card["max_model_len"] == 512  # the tiny checkpoint's context, llm_engine's 0
    assert card["root"] == str(model_dir) and card["parent"] is None
    assert card["object"] == "model" and card["owned_by"] == "pagedllm"
    assert card["permission"][0]["object"] == "model_permission"


# --- logit_bias, allowed_token_ids ------------------------------------------------------------


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_logit_bias_and_allowed_token_ids(
    gateway: str, hf: Any, tokenizer: Tokenizer, path: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 6, "return_token_ids": True, **GREEDY}
    body |= {"prompt": PROMPT} if path == "completions" else {"messages": MESSAGES}

    def ids(**extra: Any) -> list[int]:
        r = post(gateway, path, {**body, **extra})
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    greedy = ids()
    assert ids(logit_bias={"77": 100}) == [77] * 6  # +100 wins under greedy
    banned = ids(logit_bias={str(t): -100 for t in set(greedy)})
    assert not set(banned) & set(greedy)  # -100 loses wherever anything else is allowed
    assert set(ids(allowed_token_ids=[40, 41, 42], temperature=1.5, seed=3)) <= {40, 41, 42}
    # a bias never empties a grammar's mask: the choices' first tokens at -100 still give one
    choice = {"guided_choice": ["yes", "no"], "logit_bias": {"77": 100}}
    heads = {str(tokenizer.encode(w)[0]): -100 for w in ("yes", "no")}
    for extra in (choice, {**choice, "logit_bias": heads}, {**choice, "allowed_token_ids": [77]}):
        r = post(gateway, path, {**body, **extra, "ignore_eos": False}).json()["choices"][0]
        text = r["text"] if path == "completions" else r["message"]["content"]
        assert text in ("yes", "no"), extra
    for field, value, param, message in (
        ("logit_bias", {"384": 1}, "logit_bias", "'384' is not a token id (an integer from 0"),
        ("logit_bias", {"x": 1}, "logit_bias", "'x' is not a token id"),
        ("logit_bias", {"5": 100.5}, "logit_bias", "logit_bias[5]: 100.5 is outside"),
        ("logit_bias", {"5": "1"}, "logit_bias.5", "valid number"),
        ("allowed_token_ids", [1, 999], "allowed_token_ids[1]", "999 is not a token id"),
        ("allowed_token_ids", [], "allowed_token_ids", "must not be empty"),
    ):
        error = refused(gateway, path, {**body, field: value})
        assert error["param"] == param and message in error["message"], error


def test_logit_bias_through_triton(server: TritonServer) -> None:
    """vLLM's names in `sampling_parameters`, keys as JSON strings; a bad id is INVALID_ARG."""
    sampling = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"9": 100}}
    values = {"text_input": PROMPT, "sampling_parameters": json.dumps(sampling)}
    (response,) = generate(server, values)
    assert response["output_token_ids"].tolist() == [9, 9, 9]
    allowed = {**sampling, "logit_bias": {}, "allowed_token_ids": [11, 12]}
    (response,) = generate(server, {**values, "sampling_parameters": json.dumps(allowed)})
    assert set(response["output_token_ids"].tolist()) <= {11, 12}
    for bad, message in (
        ({"logit_bias": {"384": 1}}, "logit_bias: 384 is not a token id"),
        ({"logit_bias": {"3": 101}}, "logit_bias[3]: 101.0 is outside [-100, 100]"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ):
        with pytest.raises(RuntimeError, match=message.replace("[", r"\[")):
            generate(server, {**values, "sampling_parameters": json.dumps({**sampling, **bad})})
