"""Triton request parameters as `parse_request` reads them (serving/request_params.py):
vllm_backend's sampling parameters, `lora_name`, `stream` and `exclude_input_in_output`,
under the inputs; anything else refused by name. The real server's side:
test_lora_server.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedllm.serving.codec import RequestError, parse_request
from pagedllm.serving.inputs import Getter
from pagedllm.serving.request_params import as_inputs


def getter(**tensors: Any) -> Getter:
    arrays = {
        k: np.array([v], dtype=np.object_ if isinstance(v, str) else None)
        for k, v in tensors.items()
    }
    return arrays.get


def test_request_parameters_are_vllm_backends_sampling_parameters() -> None:
    get = getter(text_input="hi", sampling_parameters='{"top_k": 3}')
    req = parse_request(get, {"temperature": 0, "top_k": 5, "max_tokens": 7, "lora_name": "a"})
    assert (req.params.temperature, req.params.max_tokens, req.lora_name) == (0, 7, "a")
    assert req.params.top_k == 3  # sampling_parameters wins
    req = parse_request(getter(text_input="hi"), {"stream": True, "exclude_input_in_output": 1})
    assert req.stream and req.exclude_input_in_output
    req = parse_request(getter(text_input="hi", stream=False), {"stream": True})
    assert not req.stream  # the input wins


def test_unknown_request_parameters_are_refused_by_name() -> None:
    with pytest.raises(
        RequestError,
        match=r"^unknown request parameter 'lora_nmae'; the accepted ones: .*lora_name",
    ):
        parse_request(getter(text_input="hi"), {"lora_nmae": "a"})
    with pytest.raises(RequestError, match=r"^unknown request parameters 'a', 'b';"):
        parse_request(getter(text_input="hi"), {"b": 1, "a": 2, "top_p": 0.5})


def test_the_llm_model_sends_them_as_inputs() -> None:
    """`llm` calls llm_engine itself: the parameters become inputs there, the same request."""
    import json

    get = getter(text_input="hi", sampling_parameters='{"top_k": 3}')
    params = {"top_k": 5, "temperature": 0, "lora_name": "a", "exclude_input_in_output": True}
    inputs = as_inputs(params, get)
    assert json.loads(inputs["sampling_parameters"][0]) == {
        "top_k": 3,
        "temperature": 0,
        "lora_name": "a",
    }
    req = parse_request(lambda name: inputs.get(name, get(name)))
    assert req.exclude_input_in_output and req.params.top_k == 3 and req.lora_name == "a"
    assert as_inputs({}, get) == {}
    with pytest.raises(RequestError, match="unknown request parameter 'topk'"):
        as_inputs({"topk": 1}, get)
