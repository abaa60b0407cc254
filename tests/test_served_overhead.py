"""What the served path pays per streamed token, without Triton: `llm_engine` asks Triton
whether a client cancelled (a round trip from its stub to the server) only for its direct
clients, not for the ensemble's, whose `detokenizer` watches for the cancel; and a response
of several tokens (a non-streamed output, or a step that made more than one) is decoded by the
detokenizer into the right text with its ids and log-probs aligned."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedllm.config import EngineConfig
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.prepare import prepare_smollm2
from pagedllm.serving.codec import DOWNSTREAM_CANCEL_CHECK, parse_request
from pagedllm.serving.engine_model import EngineModel
from pagedllm.serving.engine_stream import Stream, Tensors
from pagedllm.serving.inputs import Getter
from pagedllm.serving.text_models import DetokenizerModel, TokenizerModel
from pagedllm.text.tokenizer import Tokenizer


def getter(tensors: Tensors) -> Getter:
    return tensors.get


def stream() -> Stream:
    def nothing(*_: Any) -> None:
        pass

    return Stream(
        request_id="r",
        include_stop_token=False,
        skip_special_tokens=True,
        detokenized=False,
        streamed=True,
        prefix="",
        send=nothing,
        fail=nothing,
        is_cancelled=lambda: False,
    )


@pytest.mark.parametrize("seed", range(4))
def test_detokenizer_decodes_multi_token_responses(seed: int) -> None:
    """Responses of several tokens each, cut anywhere (also inside a character): the texts
    add up to the tokenizer's own decode; ids and log-probs stay aligned; counts and indexes
    follow."""
    tokenizer = Tokenizer.from_model_dir(prepare_smollm2())
    ids = tokenizer.encode(" 東京は晴れです。😀🚀 Crème brûlée, ok!", add_special_tokens=False)
    rng = random.Random(seed)
    splits: list[int] = []
    while sum(splits) < len(ids):
        splits.append(min(rng.randint(1, 5), len(ids) - sum(splits)))
    s = stream()
    detok = DetokenizerModel(tokenizer)
    texts, tokens, logprobs, start = [], [], [], 0
    for k, size in enumerate(splits):
        part = ids[start : start + size]
        start += size
        final = "length" if start == len(ids) else None
        entries = [{t: Logprob(-float(t), 1)} for t in part]
        completion = CompletionOutput(0, "", part, None, entries, final)
        out = RequestOutput("r", None, [5, 6], [completion], finished=final is not None)
        result, _ = detok.handle(getter(s.tensors(out)))
        assert result is not None
        assert int(result["index"][0]) == k
        assert int(result["num_output_tokens"][0]) == start
        texts.append(result["text_output"][0].decode())
        tokens += result["output_token_ids"].tolist()
        logprobs += result["output_log_probs"].tolist()
    assert "".join(texts) == tokenizer.decode(ids)
    assert tokens == ids and logprobs == [-float(t) for t in ids]


def test_the_tokenizer_marks_the_ensembles_requests(checkpoints: dict[str, Path]) -> None:
    tokenizer = TokenizerModel(Tokenizer.from_model_dir(str(checkpoints["llama"])))
    for request in (
        {"text_input": np.array([b"Once upon a time"], dtype=np.object_)},
        {"input_ids": np.array([5, 6, 7], dtype=np.int32)},
    ):
        out = tokenizer.handle(getter(request))
        assert out[DOWNSTREAM_CANCEL_CHECK].tolist() == [True]
        assert parse_request(getter({**request, **out})).downstream_cancel_check
    assert not parse_request(
        getter({"text_input": np.array([b"hi"], dtype=np.object_)})
    ).downstream_cancel_check


class Client:
    """One request's responses; counts the engine's questions about its cancellation."""

    def __init__(self, cancelled: bool = False) -> None:
        self.cancelled = cancelled
        self.asked = 0
        self.responses: list[Tensors] = []
        self.done = threading.Event()

    def send(self, tensors: Tensors, final: bool) -> None:
        self.responses.append(tensors)
        if final:
            self.done.set()

    def fail(self, message: str, code: str) -> None:
        raise AssertionError(message)

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled


def request(max_tokens: int, ensemble: bool) -> Tensors:
    tensors = {
        "text_input": np.array([b"The quick brown fox"], dtype=np.object_),
        "max_tokens": np.array([max_tokens], dtype=np.int32),
        "ignore_eos": np.array([True]),
        "stream": np.array([True]),
    }
    if ensemble:
        tensors[DOWNSTREAM_CANCEL_CHECK] = np.array([True])
    return tensors


def finish_reason(client: Client) -> str:
    return bytes(client.responses[-1]["strings"][1]).decode()


def test_the_engine_asks_about_cancels_only_for_its_direct_clients(
    checkpoints: dict[str, Path],
) -> None:
    model = EngineModel(EngineConfig.create(checkpoints["llama"], dtype="float32", device="cpu"))
    try:
        direct, ensemble = Client(), Client()
        cancelled_direct, cancelled_ensemble = Client(cancelled=True), Client(cancelled=True)
        for client, via_ensemble, max_tokens in (
            (direct, False, 8),
            (ensemble, True, 8),
            (cancelled_direct, False, 400),
            (cancelled_ensemble, True, 40),
        ):
            model.handle(
                getter(request(max_tokens, via_ensemble)),
                client.send,
                client.fail,
                client.is_cancelled,
            )
        for client in (direct, ensemble, cancelled_direct, cancelled_ensemble):
            assert client.done.wait(60)
    finally:
        model.shutdown()
    assert direct.asked >= 1 and finish_reason(direct) == "length"
    # a direct client that left is seen (at its first response, or a probe before it)
    assert cancelled_direct.asked >= 1 and finish_reason(cancelled_direct) == "abort"
    # the ensemble's requests: never asked (the detokenizer asks), so never aborted here
    assert ensemble.asked == 0 and len(ensemble.responses) == 8
    assert cancelled_ensemble.asked == 0 and finish_reason(cancelled_ensemble) == "length"
