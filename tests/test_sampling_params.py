"""`SamplingParams`: conversion of string values, validation naming the field, the limits."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm import SamplingParams
from pagedllm.sampling_params import DEFAULT_MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS


def test_string_values_are_converted() -> None:
    p = SamplingParams(
        temperature="0.7",
        top_p="0.9",
        max_tokens="64",
        top_k="5",
        seed="42",
        logprobs="2",
        ignore_eos="true",
        skip_special_tokens="false",
        include_stop_str_in_output="1",
        spaces_between_special_tokens="0",
        stop="###",
        stop_token_ids="7",
    )
    assert p.temperature == 0.7 and isinstance(p.temperature, float)
    assert p.top_p == 0.9
    assert p.max_tokens == 64 and isinstance(p.max_tokens, int)
    assert p.top_k == 5 and p.seed == 42 and p.logprobs == 2
    assert p.ignore_eos is True
    assert p.skip_special_tokens is False  # "false" is not truthy
    assert p.include_stop_str_in_output is True
    assert p.spaces_between_special_tokens is False
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7]
    q = SamplingParams.from_dict({"ignore_eos": "False", "n": "3", "min_p": "0.25"})
    assert q.ignore_eos is False and q.n == 3 and q.min_p == 0.25


def test_large_integer_string_keeps_precision() -> None:
    assert SamplingParams(seed="9007199254740993").seed == 9007199254740993


@pytest.mark.parametrize("value", [0, "0", -1])
def test_top_k_zero_means_disabled(value: Any) -> None:
    assert SamplingParams(top_k=value).top_k == -1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, r"\bn\b"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"temperature": "abc"}, "temperature"),
        ({"max_tokens": "1.5"}, "max_tokens"),
        ({"top_k": 2.5}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": "nan"}, "top_p"),
        ({"max_tokens": float("nan")}, "max_tokens"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_limits_accept_the_boundary() -> None:
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, top_p=1, top_k=-1)
    SamplingParams(min_tokens=3, max_tokens=3, temperature=0, n=1)


def test_logprobs_cap() -> None:
    SamplingParams(logprobs=DEFAULT_MAX_LOGPROBS).check_logprobs_cap(DEFAULT_MAX_LOGPROBS)
    with pytest.raises(ValueError, match=r"^logprobs must be at most 20"):
        SamplingParams(logprobs=21).check_logprobs_cap(DEFAULT_MAX_LOGPROBS)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=30).check_logprobs_cap(DEFAULT_MAX_LOGPROBS)


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match=r"bogus.*temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "bogus": 1, "top_p": 0.5})
    assert SamplingParams.from_dict({"top_p": "0.5"}).top_p == 0.5
