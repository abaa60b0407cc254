"""Request tensors -> prompt + SamplingParams, the way Triton hands them over (numpy arrays
with a batch dimension; BYTES as object arrays of bytes)."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from pagedllm.serving.codec import RequestError, parse_request


def tensors(**inputs: Any) -> Any:
    arrays: dict[str, np.ndarray] = {}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, str | bytes):
            raw = value.encode() if isinstance(value, str) else value
            arrays[name] = np.array([[raw]], dtype=np.object_)
        elif isinstance(value, bool):
            arrays[name] = np.array([[value]], dtype=np.bool_)
        elif isinstance(value, int):
            arrays[name] = np.array([[value]], dtype=np.int32)
        else:
            arrays[name] = np.array([[value]], dtype=np.float32)
    return arrays.get


def test_scalars_and_json_merge_scalars_win() -> None:
    req = parse_request(
        tensors(
            text_input="Hello",
            sampling_parameters=json.dumps(
                {
                    "max_tokens": "64",
                    "temperature": "0.5",
                    "stop": ["x"],
                    "ignore_eos": "false",
                    "top_k": 5,
                }
            ),
            temperature=0.0,
            stream=True,
        )
    )
    assert req.prompt == "Hello" and req.stream and not req.exclude_input_in_output
    p = req.params
    assert (p.max_tokens, p.temperature, p.stop, p.ignore_eos, p.top_k) == (
        64,
        0.0,
        ["x"],
        False,
        5,
    )


def test_trtllm_style_inputs() -> None:
    req = parse_request(
        tensors(
            text_input="Hi",
            max_tokens=8,
            top_p=0.9,
            seed=7,
            min_tokens=2,
            return_log_probs=True,
            stop_words=np.array([[b"END", b"\xe5\x81\x9c"]], dtype=np.object_),
            exclude_input_in_output=True,
        )
    )
    p = req.params
    assert (p.max_tokens, p.seed, p.min_tokens, p.logprobs) == (8, 7, 2, 0)
    assert p.top_p == pytest.approx(0.9) and p.stop == ["END", "停"]
    assert req.exclude_input_in_output and not req.stream


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "text_input is required"),
        ({"text_input": b"\xff\xfe bad"}, "text_input is not valid UTF-8"),
        ({"text_input": np.array([[1]], dtype=np.int32)}, "text_input must be a BYTES"),
        ({"text_input": np.array([[b"a", b"b"]], dtype=np.object_)}, "exactly one value"),
        ({"text_input": "x", "sampling_parameters": "{max_tokens: 3"}, "not valid JSON"),
        ({"text_input": "x", "sampling_parameters": "[1, 2]"}, "must be a JSON object"),
        ({"text_input": "x", "sampling_parameters": "[" * 10**5}, "nested too deeply"),
        (
            {"text_input": "x", "sampling_parameters": '{"stop": "' + "a" * 300_000 + '"}'},
            "sampling_parameters is too large",
        ),
        (
            {"text_input": "x", "sampling_parameters": '{"max_token": 3, "tempreature": 1}'},
            "unknown sampling parameters: max_token, tempreature",
        ),
        ({"text_input": "x", "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"text_input": "x", "temperature": -1.0}, "temperature must be non-negative"),
        ({"text_input": "x", "max_tokens": "abc"}, "max_tokens must be an integer"),
        ({"text_input": "x", "stream": "maybe"}, "stream must be a boolean"),
        (
            {"text_input": "x", "top_p": np.array([[0.5, 0.6]], dtype=np.float32)},
            "top_p must hold exactly one value",
        ),
    ],
)
def test_bad_requests_get_clear_errors(inputs: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_request(tensors(**inputs))


def test_empty_json_and_defaults() -> None:
    req = parse_request(tensors(text_input="x", sampling_parameters=""))
    assert req.params.max_tokens == 16 and req.params.temperature == 1.0 and not req.stream


def test_input_ids_from_the_tokenizer_model_are_the_prompt() -> None:
    req = parse_request(tensors(text_input="Hi", input_ids=np.array([[5, 6, 7]], dtype=np.int32)))
    assert req.prompt == "Hi" and req.prompt_token_ids == [5, 6, 7]
    assert parse_request(tensors(text_input="Hi")).prompt_token_ids is None
    with pytest.raises(RequestError, match="input_ids must be integers"):
        parse_request(tensors(text_input="Hi", input_ids=np.array([[0.5]], dtype=np.float32)))


def test_n_sequences_up_to_a_cap() -> None:
    assert parse_request(tensors(text_input="Hi", sampling_parameters='{"n": 3}')).params.n == 3
    assert parse_request(tensors(text_input="Hi", num_return_sequences=2)).params.n == 2
    with pytest.raises(RequestError, match="n must be at most 64, got 65"):
        parse_request(tensors(text_input="Hi", sampling_parameters='{"n": 65}'))


def test_return_timing_flag() -> None:
    assert parse_request(tensors(text_input="Hi", return_timing=True)).return_timing
    assert not parse_request(tensors(text_input="Hi")).return_timing


def test_instance_device_follows_the_instance_kind() -> None:
    from pagedllm.serving.settings import instance_device

    assert instance_device({}) == "cpu"
    assert instance_device({}, "GPU", 2) == "cuda:2"  # KIND_GPU: the GPU Triton gave it
    assert instance_device({"device": "cuda"}, "CPU", 0) == "cuda:0"
    assert instance_device({"device": "cpu"}, "GPU", 1) == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        instance_device({"device": "tpu"})


def test_cancel_polls_ask_each_request_at_most_once_per_interval() -> None:
    from pagedllm.serving.cancel_polls import CancelPolls

    polls = CancelPolls(interval=0.2, max_entries=3)
    assert polls.due("a", final=False)  # a request's first response is always asked
    assert not polls.due("a", final=False)  # then not again within the interval
    assert polls.due("b", final=False)  # per request
    time.sleep(0.25)
    assert polls.due("a", final=False)
    assert not polls.due("a", final=False)
    assert not polls.due("b", final=True)  # never on a final response, which forgets it
    assert polls.due("b", final=False)
    polls.forget("b")
    assert polls.due("b", final=False)
    for key in "cdef":  # bounded: the oldest entries go first
        polls.due(key, final=False)
    assert polls.due("a", final=False)  # dropped, so asked again at once
    assert not polls.due("f", final=False)


def test_structured_outputs_are_refused_by_name() -> None:
    body = '{"structured_outputs": "{\\"choice\\": [\\"a\\", \\"b\\"]}"}'
    with pytest.raises(RequestError, match="structured_outputs: structured outputs are not"):
        parse_request(tensors(text_input="Hi", sampling_parameters=body))
