"""Structured outputs through every Triton entry point on a real tritonserver (tiny random
Llama), in each client family's spelling: vLLM's `sampling_parameters` keys
(`structured_outputs` as an object or its JSON text, `guided_decoding`, `guided_json`, ...)
on `ensemble` and `llm`; TensorRT-LLM's `guided_decoding_guide_type` + `guided_decoding_guide`
on `ensemble`, `llm`, `tensorrt_llm_bls` and `tensorrt_llm`.

Oracles: every output is checked on its own (`jsonschema`, `re.fullmatch`, choice membership)
and must end with finish_reason "stop"; and it must equal the offline engine's output under
the same constraint and seed (so the spelling reached the engine as that constraint). The
random model ends a constrained output only where its grammar lets it: each case's seed is
the first whose offline output ends within MAX_TOKENS. Bad constraints are refused with
INVALID_ARG (gRPC) / 400 (HTTP) naming the problem, before any token is generated."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import jsonschema
import numpy as np
import pytest
import server_metrics
from grpc_stream import GrpcStream, grpc_inputs
from test_server import post
from test_trtllm_bls import run_inference, texts

from pagedllm import LLM, SamplingParams
from pagedllm.serving.tritonserver import TritonServer

SHARES_SERVER = True  # conftest's session server: requests only, metrics read as deltas
PROMPT = "Once upon a time"
MAX_TOKENS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["fox", "dog", "engineer"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 4},
    },
    "required": ["id", "kind", "ok", "name"],
    "additionalProperties": False,
}
# for spellings with no whitespace option (TensorRT-LLM's): few places for free whitespace
SMALL = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
REGEX = r"(quick|lazy)-[a-z]{1,5}-[0-9]{1,3}"
CHOICES = ["fox", "dog", "paged attention"]
GBNF = 'root ::= "city " [0-9] [0-9]? ("," [0-9])?'
GBNF_TEXT = r"city [0-9][0-9]?(,[0-9])?"  # the same language, for re.fullmatch
TIGHT = "xgrammar:disable-any-whitespace"  # vLLM 0.8's backend option: no free whitespace


def is_json(schema: dict[str, Any] | None) -> Callable[[str], bool]:
    """Valid JSON under `schema` (None: any object); jsonschema raises otherwise."""
    return lambda text: jsonschema.validate(json.loads(text), schema or {"type": "object"}) is None


# case -> (the constraint as the engine takes it, the independent check of an output)
CASES: dict[str, tuple[dict[str, Any], Callable[[str], bool]]] = {
    "schema": ({"json": SCHEMA, "disable_any_whitespace": True}, is_json(SCHEMA)),
    "small": ({"json": SMALL}, is_json(SMALL)),
    "object": ({"json_object": True}, is_json(None)),
    "object_tight": ({"json_object": True, "disable_any_whitespace": True}, is_json(None)),
    "regex": ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": ({"choice": CHOICES}, lambda t: t in CHOICES),
    "grammar": ({"grammar": GBNF}, lambda t: re.fullmatch(GBNF_TEXT, t) is not None),
}


class Oracle:
    """Each case's seed and expected text: the offline engine's first seeded output under the
    case's constraint that ends (finish_reason stop) within MAX_TOKENS."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.found: dict[str, tuple[int, str]] = {}

    def __call__(self, case: str) -> tuple[int, str]:
        if case not in self.found:
            constraint, valid = CASES[case]
            for seed in range(64):
                params = SamplingParams(
                    temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=constraint
                )
                out = self.llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
                if out.finish_reason == "stop":
                    assert valid(out.text), out.text  # the engine's own output, checked
                    self.found[case] = (seed, out.text)
                    break
            else:
                pytest.fail(f"no seed ends a {case} output within {MAX_TOKENS} tokens")
        return self.found[case]


@pytest.fixture(scope="module")
def oracle(llm: LLM) -> Oracle:
    return Oracle(llm)


def sampling(seed: int, **extra: Any) -> str:
    return json.dumps({"temperature": 1.0, "seed": seed, "max_tokens": MAX_TOKENS, **extra})


def check(case: str, text: str, finish_reason: str, expected: str) -> None:
    assert finish_reason == "stop", (case, text, finish_reason)
    assert CASES[case][1](text), (case, text)
    assert text == expected, (case, text, expected)


def ensemble(server: TritonServer, values: dict[str, Any]) -> tuple[str, str]:
    """`ensemble` over a gRPC stream (streamed unless values say stream=false): the text
    (streamed deltas joined) and the last finish_reason."""
    s = GrpcStream(server, {"text_input": PROMPT, "exclude_input_in_output": True, **values})
    text = s.wait()
    return text, s.responses[-1][1]["finish_reason"]


def kserve_infer(server: TritonServer, model: str, values: dict[str, Any]) -> tuple[int, Any]:
    """A plain KServe v2 JSON `infer` over HTTP: (status, {output: data} or the error)."""
    types = {str: "BYTES", bool: "BOOL", int: "INT32", float: "FP32"}
    inputs = [
        {"name": n, "shape": [1], "datatype": types[type(v)], "data": [v]}
        for n, v in {"text_input": PROMPT, **values}.items()
    ]
    status, body = post(f"{server.http_url}/v2/models/{model}/infer", {"inputs": inputs})
    reply = json.loads(body)
    if status != 200:
        return status, reply.get("error")
    return status, {o["name"]: o["data"] for o in reply["outputs"]}


def llmapi(server: TritonServer, values: dict[str, Any]) -> Any:
    """`tensorrt_llm` (TensorRT-LLM's LLM-API model) by unary gRPC infer, as llmapi_client.py."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = {
        "text_input": PROMPT,
        "sampling_param_max_tokens": MAX_TOKENS,
        "sampling_param_temperature": 1.0,
        "sampling_param_exclude_input_from_output": True,
        "return_finish_reason": True,
        **values,
    }
    return client.infer("tensorrt_llm", grpc_inputs(inputs))


def guide(case: str) -> tuple[str, str]:
    """TensorRT-LLM's guide type and guide for a case."""
    constraint = CASES[case][0]
    if "json_object" in constraint:
        return "json", ""
    if "json" in constraint:
        return "json_schema", json.dumps(constraint["json"])
    if "regex" in constraint:
        return "regex", constraint["regex"]
    return "ebnf_grammar", constraint["grammar"]


# --- vLLM's spellings in sampling_parameters ----------------------------------------------------


@pytest.mark.parametrize(
    ("case", "spelling", "stream"),
    [
        # vllm_backend's: the object's JSON text inside sampling_parameters
        ("schema", lambda c: {"structured_outputs": json.dumps(c)}, True),
        ("choice", lambda c: {"structured_outputs": c}, False),
        # the older GuidedDecodingParams object, and its JSON text
        ("regex", lambda c: {"guided_decoding": c}, True),
        ("grammar", lambda c: {"guided_decoding": json.dumps(c)}, False),
        # vLLM's OpenAI-server keys; an option in the backend name, as vLLM 0.8 read it
        ("schema", lambda c: {"guided_json": SCHEMA, "guided_decoding_backend": TIGHT}, False),
        ("choice", lambda c: {"guided_choice": CHOICES}, True),
        (
            "object_tight",
            lambda c: {"guided_json_object": True, "guided_decoding_backend": TIGHT},
            True,
        ),
    ],
)
def test_vllm_spellings_on_the_ensemble(
    server: TritonServer, oracle: Oracle, case: str, spelling: Callable[[Any], Any], stream: bool
) -> None:
    seed, expected = oracle(case)
    body = sampling(seed, **spelling(CASES[case][0]))
    text, finish = ensemble(server, {"sampling_parameters": body, "stream": stream})
    check(case, text, finish, expected)


def test_vllm_spellings_on_llm_over_kserve_infer(server: TritonServer, oracle: Oracle) -> None:
    for case, spelling in [
        ("regex", {"guided_regex": REGEX}),
        ("schema", {"structured_outputs": CASES["schema"][0]}),
        ("grammar", {"guided_grammar": GBNF}),
    ]:
        seed, expected = oracle(case)
        values = {
            "sampling_parameters": sampling(seed, **spelling),
            "exclude_input_in_output": True,
        }
        status, out = kserve_infer(server, "llm", values)
        assert status == 200, out
        check(case, out["text_output"][0], out["finish_reason"][0], expected)


# --- TensorRT-LLM's tensors -------------------------------------------------------------------


@pytest.mark.parametrize("case", ["small", "object", "regex", "grammar"])
def test_trtllm_guide_tensors_on_the_ensemble(
    server: TritonServer, oracle: Oracle, case: str
) -> None:
    seed, expected = oracle(case)
    guide_type, text = guide(case)
    values = {"sampling_parameters": sampling(seed), "guided_decoding_guide_type": guide_type}
    if text:
        values["guided_decoding_guide"] = text
    check(case, *ensemble(server, values), expected)


def test_trtllm_guide_tensors_on_llm(server: TritonServer, oracle: Oracle) -> None:
    seed, expected = oracle("small")
    values = {
        "sampling_parameters": sampling(seed),
        "exclude_input_in_output": True,
        "guided_decoding_guide_type": "json_schema",
        "guided_decoding_guide": json.dumps(SMALL),
    }
    status, out = kserve_infer(server, "llm", values)
    assert status == 200, out
    check("small", out["text_output"][0], out["finish_reason"][0], expected)


def test_trtllm_guide_tensors_on_tensorrt_llm_bls(server: TritonServer, oracle: Oracle) -> None:
    """One request, four batch items, each under its own guide type (as end_to_end_grpc_client.py
    --guided-decoding-guide-type sends them, [B, 1])."""
    cases = ["small", "object", "regex", "grammar"]
    seeds, expected = zip(*(oracle(c) for c in cases), strict=True)
    column = lambda values, dtype: np.array([[v] for v in values], dtype=dtype)  # noqa: E731
    n = len(cases)
    inputs = {
        "text_input": column([PROMPT] * n, object),
        "max_tokens": column([MAX_TOKENS] * n, np.int32),
        "stream": column([True] * n, bool),
        "exclude_input_in_output": column([True] * n, bool),
        "temperature": column([1.0] * n, np.float32),
        "top_p": column([1.0] * n, np.float32),  # sampled: TensorRT-LLM is greedy without it
        "seed": column(seeds, np.uint64),
        "guided_decoding_guide_type": column([guide(c)[0] for c in cases], object),
        "guided_decoding_guide": column([guide(c)[1] for c in cases], object),
    }
    results = run_inference(server, inputs, outputs=("text_output", "batch_index"))
    outputs = texts(results, batch_size=n, streaming=True)
    for case, text, want in zip(cases, outputs, expected, strict=True):
        check(case, text, "stop", want)  # (the BLS contract has no finish_reason output)


@pytest.mark.parametrize("case", ["small", "object", "regex", "grammar"])
def test_trtllm_guide_tensors_on_tensorrt_llm(
    server: TritonServer, oracle: Oracle, case: str
) -> None:
    seed, expected = oracle(case)
    guide_type, text = guide(case)
    values: dict[str, Any] = {
        "sampling_param_seed": np.array([seed], dtype=np.uint64),
        "guided_decoding_guide_type": guide_type,
    }
    if text:
        values["guided_decoding_guide"] = text
    result = llmapi(server, values)
    finish = result.as_numpy("finish_reason")[0].decode()
    check(case, result.as_numpy("text_output")[0].decode(), finish, expected)


# --- errors: refused by name, before any token --------------------------------------------------

BAD_REGEX = {"guided_regex": "(quick|lazy"}
BAD_SCHEMA = {"type": "objekt"}
BAD_SCHEMA_TEXT = json.dumps(BAD_SCHEMA)
BAD_GRAMMAR = 'root ::= "a" missing'


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sampling_parameters": json.dumps(BAD_REGEX)}, "invalid regex constraint"),
        (
            {"sampling_parameters": json.dumps({"structured_outputs": {"json": BAD_SCHEMA}})},
            "invalid json constraint: .*objekt",
        ),
        (
            {"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": BAD_GRAMMAR},
            "invalid grammar constraint: .*missing",
        ),
        (
            {"guided_decoding_guide_type": "structural_tag", "guided_decoding_guide": "{}"},
            "structural_tag must be an object with a list of structures",
        ),
        (
            {"guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"},
            "guided_decoding_guide_type must be one of json, json_schema, regex",
        ),
        (
            {"guided_decoding_guide": "[0-9]+"},
            "guided_decoding_guide needs guided_decoding_guide_type",
        ),
        (
            {
                "sampling_parameters": json.dumps({"guided_choice": CHOICES}),
                "guided_decoding_guide_type": "regex",
                "guided_decoding_guide": REGEX,
            },
            "guided_choice and guided_decoding_guide_type each ask for structured outputs",
        ),
        (
            {"sampling_parameters": json.dumps({"guided_json": SMALL, "guided_regex": REGEX})},
            "guided_json, guided_regex: send one structured-output constraint",
        ),
    ],
)
def test_errors_on_the_ensemble_stream(
    server: TritonServer, values: dict[str, Any], message: str
) -> None:
    s = GrpcStream(server, {"text_input": PROMPT, "max_tokens": 8, **values})
    assert s.done.wait(60)
    s.client.stop_stream()
    assert not s.responses  # no token streamed before the error
    # (a streamed error carries no status code in tritonclient: the other tests check it)
    assert s.error is not None and re.search(message, s.error.message()), s.error


def test_errors_on_every_other_entry_point(server: TritonServer) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    before = server_metrics.metrics(server.metrics_url)
    bad_guide = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{"}
    # ensemble over HTTP generate, llm over KServe infer: 400 naming the problem
    status, reply = post(
        f"{server.http_url}/v2/models/ensemble/generate",
        {"text_input": PROMPT, "max_tokens": 8, "sampling_parameters": json.dumps(BAD_REGEX)},
    )
    assert status == 400 and "invalid regex constraint" in reply, reply
    status, error = kserve_infer(server, "llm", {"max_tokens": 8, **bad_guide})
    assert status == 400 and "json is not valid JSON" in error, error
    # llm over unary gRPC: INVALID_ARGUMENT
    bad_schema = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "[]"}
    with pytest.raises(InferenceServerException, match="json must be a JSON schema") as raised:
        grpcclient.InferenceServerClient(server.grpc_url).infer(
            "llm", grpc_inputs({"text_input": PROMPT, **bad_schema})
        )
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    # tensorrt_llm_bls: a batch whose second item is bad fails whole, before the first runs
    column = lambda values: np.array([[v] for v in values], dtype=object)  # noqa: E731
    inputs = {
        "text_input": column([PROMPT, PROMPT]),
        "max_tokens": np.array([[8], [8]], dtype=np.int32),
        "stream": np.array([[True], [True]]),
        "guided_decoding_guide_type": column(["regex", "ebnf_grammar"]),
        "guided_decoding_guide": column([REGEX, BAD_GRAMMAR]),
    }
    [error] = run_inference(server, inputs)
    assert isinstance(error, InferenceServerException), error  # the only response
    assert "invalid grammar constraint" in error.message()
    # tensorrt_llm: unary gRPC
    for values, message in [
        (bad_guide, "json is not valid JSON"),
        ({**bad_guide, "guided_decoding_guide": BAD_SCHEMA_TEXT}, "invalid json constraint"),
        ({"guided_decoding_guide_type": "json_schema"}, "json_schema needs guided_decoding_guide"),
    ]:
        with pytest.raises(InferenceServerException, match=message) as raised:
            llmapi(server, values)
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    # none of them generated a token (nor scheduled a prompt): one good request moves the
    # counters by its own tokens only
    status, out = kserve_infer(server, "llm", {"max_tokens": 3, "ignore_eos": True})
    assert status == 200, out
    deadline = time.monotonic() + 10
    while True:
        after = server_metrics.metrics(server.metrics_url)
        moved = {k: after[k] - before.get(k, 0.0) for k in (GENERATED, PROMPTS)}
        if moved[GENERATED] >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert moved == {GENERATED: 3, PROMPTS: out["num_input_tokens"][0]}


GENERATED, PROMPTS = "vllm:generation_tokens_total", "vllm:prompt_tokens_total"
