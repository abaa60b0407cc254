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
            {"text_input": "x", "sampling_parameters": '{"stop": "' + "a" * 600_000 + '"}'},
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


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def structured(**inputs: Any) -> Any:
    """The request's StructuredOutputsParams (None when it asks for no constraint)."""
    body = inputs.pop("sampling_parameters", None)
    if body is not None and not isinstance(body, str):
        body = json.dumps(body)
    extra = {} if body is None else {"sampling_parameters": body}
    return parse_request(tensors(text_input="Hi", **extra, **inputs)).params.structured_outputs


@pytest.mark.parametrize(
    ("body", "field", "value"),
    [
        # vllm_backend's current spelling: the object's JSON text inside the JSON
        ({"structured_outputs": json.dumps({"choice": ["a", "b"]})}, "choice", ["a", "b"]),
        ({"structured_outputs": {"regex": "[a-z]{2}"}}, "regex", "[a-z]{2}"),
        # its older one (vLLM's GuidedDecodingParams), as text or object
        ({"guided_decoding": json.dumps({"json": SCHEMA})}, "json", SCHEMA),
        ({"guided_decoding": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"'),
        # vLLM's OpenAI-server keys; a schema may be its text
        ({"guided_json": SCHEMA}, "json", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"guided_grammar": 'start: "x"'}, "grammar", 'start: "x"'),
        ({"guided_json_object": "true"}, "json_object", True),
    ],
)
def test_vllm_structured_output_spellings(body: dict[str, Any], field: str, value: Any) -> None:
    spec = structured(sampling_parameters=body)
    assert spec.kind == field and getattr(spec, field) == value


def test_vllm_structured_output_options() -> None:
    spec = structured(
        sampling_parameters={
            "guided_json": SCHEMA,
            "guided_whitespace_pattern": " ?",
            "guided_decoding_backend": "xgrammar:disable-any-whitespace,no-additional-properties",
        }
    )
    assert (spec.json, spec.whitespace_pattern, spec.backend) == (SCHEMA, " ?", "xgrammar")
    assert spec.disable_any_whitespace and spec.disable_additional_properties
    # booleans as strings ("false" is false); null fields and vLLM's internal ones are ignored
    spec = structured(
        sampling_parameters={
            "guided_decoding": {
                "json_object": "true",
                "regex": None,
                "disable_any_whitespace": "false",
                "backend_was_auto": False,
            }
        }
    )
    assert spec.json_object is True and spec.disable_any_whitespace is False
    # the flat options apply to the one constraint, wherever it comes from
    spec = structured(
        sampling_parameters={"structured_outputs": {"regex": "a+"}, "guided_decoding_backend": "x"}
    )
    assert (spec.regex, spec.backend) == ("a+", "x")


def test_no_constraint_asked() -> None:
    assert structured() is None
    assert structured(sampling_parameters={"structured_outputs": None}) is None
    assert structured(sampling_parameters={"guided_decoding": ""}) is None
    # vLLM ignores its options without a constraint, and guided_json_object false
    assert structured(sampling_parameters={"guided_decoding_backend": "xgrammar"}) is None
    assert structured(sampling_parameters={"guided_json_object": False}) is None
    # TensorRT-LLM reads an empty guide type and guide as no guide
    assert structured(guided_decoding_guide_type="", guided_decoding_guide="") is None


@pytest.mark.parametrize(
    ("guide_type", "guide", "field", "value"),
    [
        ("json", None, "json_object", True),
        ("json", "", "json_object", True),
        ("json_schema", json.dumps(SCHEMA), "json", json.dumps(SCHEMA)),
        ("regex", "[0-9]{4}", "regex", "[0-9]{4}"),
        ("ebnf_grammar", "root ::= [0-9]+", "grammar", "root ::= [0-9]+"),
        ("structural_tag", '{"structures": []}', "structural_tag", '{"structures": []}'),
    ],
)
def test_trtllm_guide_tensors(guide_type: str, guide: str | None, field: str, value: Any) -> None:
    inputs = {"guided_decoding_guide_type": guide_type}
    if guide is not None:
        inputs["guided_decoding_guide"] = guide
    spec = structured(**inputs)
    assert spec.kind == field and getattr(spec, field) == value


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            {"sampling_parameters": {"guided_json": SCHEMA, "guided_regex": "x"}},
            "guided_json, guided_regex: send one structured-output constraint, not 2",
        ),
        (
            {"sampling_parameters": {"structured_outputs": {"regex": "x"}, "guided_choice": ["a"]}},
            "structured_outputs and guided_choice each ask for structured outputs: send one",
        ),
        (
            {
                "sampling_parameters": {"guided_decoding": {"regex": "x"}},
                "guided_decoding_guide_type": "json",
            },
            "guided_decoding and guided_decoding_guide_type each ask",
        ),
        (
            {"sampling_parameters": {"structured_outputs": {"regex": "x", "choice": ["a"]}}},
            "structured_outputs: structured outputs need exactly one of .*got regex, choice",
        ),
        ({"sampling_parameters": {"structured_outputs": "{x"}}, "structured_outputs is not valid"),
        ({"sampling_parameters": {"guided_decoding": [1]}}, "guided_decoding must be an object"),
        ({"sampling_parameters": {"guided_decoding": {"jsn": {}}}}, "unknown guided_decoding keys"),
        ({"sampling_parameters": {"guided_choice": "yes"}}, "guided_choice: choice must be a list"),
        (
            {"sampling_parameters": {"guided_regex": "a", "guided_decoding_backend": "x:fast"}},
            "backend option 'fast' is not one of",
        ),
        (
            {
                "sampling_parameters": {
                    "structured_outputs": {"regex": "a", "whitespace_pattern": " "},
                    "guided_whitespace_pattern": "  ",
                }
            },
            "guided_whitespace_pattern and structured_outputs.whitespace_pattern disagree",
        ),
        ({"guided_decoding_guide_type": "yaml"}, "guided_decoding_guide_type must be one of json,"),
        (
            {"guided_decoding_guide": "[0-9]+"},
            "guided_decoding_guide needs guided_decoding_guide_t",
        ),
        (
            {"guided_decoding_guide_type": "regex"},
            "guided_decoding_guide_type regex needs guided_d",
        ),
        (
            {"guided_decoding_guide_type": "json", "guided_decoding_guide": json.dumps(SCHEMA)},
            "json takes no guide",
        ),
    ],
)
def test_structured_output_errors_name_the_problem(inputs: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        structured(**inputs)


def test_check_refuses_what_does_not_compile_without_a_tokenizer() -> None:
    from pagedllm.serving.structured import check
    from pagedllm.structured.params import StructuredOutputsParams

    check(StructuredOutputsParams(json=SCHEMA))
    for spec, message in [
        (StructuredOutputsParams(regex="a(b"), "invalid regex constraint: .*unclosed group"),
        (StructuredOutputsParams(json={"type": "objekt"}), "invalid json constraint: .*objekt"),
        (StructuredOutputsParams(grammar="root ::= foo"), "invalid grammar constraint"),
    ]:
        with pytest.raises(ValueError, match=message):
            check(spec)
