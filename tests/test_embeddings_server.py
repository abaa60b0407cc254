"""Embeddings through a real tritonserver with the pooling runner (`PAGEDLLM_RUNNER=pooling`,
what `pagedllm serve --runner pooling` sets) and the real gateway: the official `openai`
client on /v1/embeddings, vllm_backend's `embedding_request` and the typed entry on `llm`
(tritonclient), each equal to HF transformers' pooled hidden states."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import tritonclient.http as httpclient
from openai_gateway import MODEL, running_gateway, with_chat_template
from test_embeddings import assert_close, hf_base, hf_embeddings

from pagedllm.serving.tritonserver import TritonServer
from pagedllm.text.tokenizer import Tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention", "Bonjour 😀"]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("embed") / MODEL
    shutil.copytree(checkpoints["llama"], path)
    return with_chat_template(path)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    from pagedllm.serving.launcher import make_server

    env = {"PAGEDLLM_RUNNER": "pooling", "PAGEDLLM_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}
    work = tmp_path_factory.mktemp("triton")
    with make_server(str(model_dir), dtype="float32", work_dir=work, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(
    server: TritonServer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with running_gateway(server, model_dir, log) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Tokenizer, object]:
    return Tokenizer.from_model_dir(model_dir), hf_base(model_dir)


def oracle(reference: tuple[Tokenizer, object], prompts: list[list[int]]) -> torch.Tensor:
    return hf_embeddings(reference[1], prompts, "LAST", True)


def test_openai_client_every_input_form(client: openai.OpenAI, reference: tuple) -> None:
    tok = reference[0]
    ids = [tok.encode(t) for t in TEXTS]
    for given in (TEXTS, ids):
        out = client.embeddings.create(model=MODEL, input=given, encoding_format="float")
        assert [d.index for d in out.data] == [0, 1, 2]
        assert_close(torch.tensor([d.embedding for d in out.data]), oracle(reference, ids))
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    two = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert one.data[0].embedding == two.data[0].embedding
    assert_close(torch.tensor([one.data[0].embedding]), oracle(reference, ids[:1]))
    # base64: little-endian float32, the same values
    raw = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(str(raw.data[0].embedding)), dtype="<f4")
    assert decoded.tolist() == one.data[0].embedding
    # the client's default: base64 on the wire, decoded by the client
    assert list(client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding) == (
        one.data[0].embedding
    )


def test_refusals_and_truncation(client: openai.OpenAI, reference: tuple) -> None:
    for bad in ("", [], [[]]):
        with pytest.raises(openai.BadRequestError, match="empty"):
            client.embeddings.create(model=MODEL, input=bad)
    long = list(range(2, 2 + MAX_MODEL_LEN + 6))
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.embeddings.create(model=MODEL, input=long)
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model=MODEL, input="hi", dimensions=16)
    cut = client.embeddings.create(
        model=MODEL, input=long, encoding_format="float", extra_body={"truncate_prompt_tokens": 8}
    )
    assert cut.usage.prompt_tokens == 8
    assert_close(torch.tensor([cut.data[0].embedding]), oracle(reference, [long[-8:]]))
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def infer(server: TritonServer, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    http = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    tensors = []
    for name, value in inputs.items():
        dtype = {np.dtype(object): "BYTES", np.dtype(bool): "BOOL"}.get(value.dtype, "INT32")
        t = httpclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        tensors.append(t)
    result = http.infer("llm", tensors)
    names = ("text_output", "embedding", "num_input_tokens", "num_output_tokens")
    return {n: a for n in names if (a := result.as_numpy(n)) is not None}


def test_triton_llm_model(server: TritonServer, reference: tuple) -> None:
    ids = reference[0].encode(TEXTS[0])
    want = oracle(reference, [ids])
    # vllm_backend's request: JSON in, JSON text_output out, counts when asked
    body = {"input": TEXTS[0], "pooling_params": {"dimensions": [64]}}
    out = infer(
        server,
        {
            "embedding_request": np.array([json.dumps(body).encode()], dtype=object),
            "return_num_input_tokens": np.array([True]),
            "return_num_output_tokens": np.array([True]),
        },
    )
    assert_close(torch.tensor([json.loads(out["text_output"][0])]), want)
    assert int(out["num_input_tokens"][0]) == len(ids) and int(out["num_output_tokens"][0]) == 0
    # typed: text_input or input_ids in, an FP32 embedding out
    typed = infer(server, {"text_input": np.array([TEXTS[0].encode()], dtype=object)})
    assert typed["embedding"].dtype == np.float32 and "num_input_tokens" not in typed
    assert_close(torch.tensor(typed["embedding"]).reshape(1, -1), want)
    by_ids = infer(server, {"input_ids": np.array(ids, dtype=np.int32)})
    assert by_ids["embedding"].tolist() == typed["embedding"].tolist()
    bad = {"embedding_request": np.array([b'{"input": []}'], dtype=object)}
    with pytest.raises(Exception, match="empty"):
        infer(server, bad)
