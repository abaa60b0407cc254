"""TensorRT-LLM's LLM-API clients against the real server: llmapi_client.py to `tensorrt_llm`
(unary `async_infer`, its stop request, its cancel) and end_to_end_test.py --test-llmapi's
request (HTTP `infer`). The oracle is the offline engine: the LLM API decodes greedily when no
sampling parameter is sent. The adapter's rules are checked offline first
(pagedllm.serving.trtllm_llmapi)."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import server_metrics
from test_beam_serving import EOS_PROMPT
from test_trtllm_bls import PROMPT, aborted, greedy

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams
from pagedllm.serving.codec import RequestError
from pagedllm.serving.tritonserver import TritonServer
from pagedllm.serving.trtllm_llmapi import LlmApiModel, Run
from pagedllm.text.tokenizer import Tokenizer


def test_llmapi_request_defaults_and_refusals(checkpoints: dict[str, Path]) -> None:
    model = LlmApiModel(Tokenizer.from_model_dir(checkpoints["llama"]), 1 << 20)
    text = {"text_input": np.array([PROMPT.encode()], dtype=object)}
    request = model.request(text.get)
    assert request.inputs["max_tokens"].tolist() == [32]  # the LLM API's default
    assert request.inputs["temperature"].tolist() == [0.0]
    for extra, message in [
        ({"sampling_param_best_of": np.array([2], dtype=np.int32)}, "needs sampling_param_use"),
        (
            {"sampling_param_n": np.array([3], dtype=np.int32), **use_beams(2)},
            r"sampling_param_n \(3\) <=",
        ),
        ({"beam_width": np.array([3], dtype=np.int32), **use_beams(2)}, "disagree"),
        ({"sampling_param_return_perf_metrics": np.array([True])}, "not supported"),
        ({"text_input": np.array([], dtype=object)}, "text_input is missing"),
    ]:
        with pytest.raises(RequestError, match=message):
            model.request({**text, **extra}.get)
    # the LLM API's beams: width best_of (or n), the n best returned; TensorRT-LLM's beam_width
    beams = model.request({**text, **use_beams(3), "sampling_param_n": np.array([2], np.int32)}.get)
    assert beams.inputs["beam_width"].tolist() == [3] and beams.n == 2
    alias = model.request({**text, "beam_width": np.array([4], dtype=np.int32)}.get)
    assert alias.inputs["beam_width"].tolist() == [4] and alias.n == 1
    for value, mode in [(1, True), (0, False), (2, "never")]:
        stop = {"sampling_param_early_stopping": np.array([value], dtype=np.int32)}
        inputs = model.request({**text, **use_beams(2), **stop}.get).inputs
        assert json.loads(inputs["sampling_parameters"][0]) == {"early_stopping": mode}
    sampled = model.request({**text, "sampling_param_n": np.array([2], dtype=np.int32)}.get)
    assert (
        sampled.inputs["num_return_sequences"].tolist() == [2]
        and "beam_width" not in sampled.inputs
    )
    assert model.stop("").error == "A request id must be provided for request cancellation"
    assert model.stop("nobody").code == "CANCELLED"  # stopping nothing is answered alike


def use_beams(width: int) -> dict[str, np.ndarray]:
    return {
        "sampling_param_use_beam_search": np.array([True]),
        "sampling_param_best_of": np.array([width], dtype=np.int32),
    }


# --- tensorrt_llm (the LLM-API model) -----------------------------------------------------------


SHARES_SERVER = True  # conftest's session server: requests only, metrics read as deltas
OTHERS_LEN = 64
TARGET_LEN = 2000  # tokens of the slow checkpoint: seconds on any machine


def llmapi_tensor(name: str, value: np.ndarray) -> Any:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


def llmapi_inputs(prompt: str, output_len: int) -> list[Any]:
    """llmapi_client._prepare_inputs."""
    return [
        llmapi_tensor("text_input", np.array([prompt], dtype=object)),
        llmapi_tensor("sampling_param_max_tokens", np.array([output_len], dtype=np.int32)),
    ]


def stop_signals() -> list[Any]:
    """llmapi_client.prepare_stop_signals."""
    import tritonclient.grpc as grpcclient

    inputs = [
        grpcclient.InferInput("text_input", [1], "BYTES"),
        grpcclient.InferInput("stop", [1], "BOOL"),
    ]
    inputs[0].set_data_from_numpy(np.empty([1], dtype=np.bytes_))
    inputs[1].set_data_from_numpy(np.array([True], dtype="bool"))
    return inputs


def test_llmapi_client(server: TritonServer, llm: LLM) -> None:
    import tritonclient.grpc as grpcclient

    prompt = "Born in north-east France, Soyer trained as a"
    completed: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.async_infer(
            "tensorrt_llm",
            llmapi_inputs(prompt, 16),
            outputs=None,
            request_id="1",
            callback=lambda result, error: completed.put(error or result),
            parameters={"Streaming": False},  # ignored, as upstream
        )
        result = completed.get(timeout=60)
    assert not isinstance(result, Exception), result
    assert result.as_numpy("text_output")[0].decode() == prompt + greedy(llm, prompt, 16)


@pytest.mark.parametrize("how", ["stop request", "request cancel"])
def test_llmapi_client_stops_a_request(
    slow_shared_server: TritonServer, slow_checkpoint: Path, how: str
) -> None:
    """llmapi_client.py --stop-after-ms (a stop request with the same request id, or
    --stop-via-request-cancel): the request ends as CANCELLED and its engine request is
    aborted (at its first probe); requests under other ids run on untouched."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    server = slow_shared_server
    llm = LLM(str(slow_checkpoint), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=TARGET_LEN)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"  # no EOS: it runs for seconds
    expected = PROMPT + greedy(llm, PROMPT, OTHERS_LEN)
    before = aborted(server)
    generated = server_metrics.metrics(server.metrics_url).get("vllm:generation_tokens_total", 0)
    completed: queue.Queue[tuple[str, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:

        def send(request_id: str, inputs: list[Any]) -> Any:
            def callback(result: Any, error: Any) -> None:
                completed.put((request_id, error or result))

            return client.async_infer(
                "tensorrt_llm", inputs, request_id=request_id, callback=callback
            )

        future = send("target", llmapi_inputs(PROMPT, TARGET_LEN))
        # running: registered under its id (a stop or cancel that came first would miss it)
        server_metrics.wait_running(server.metrics_url, 1, timeout=30)
        for k in range(4):
            send(f"other-{k}", llmapi_inputs(PROMPT, OTHERS_LEN))
        time.sleep(0.1)
        if how == "stop request":
            send("target", stop_signals())
        else:
            future.cancel()
        answers: dict[str, list[Any]] = {}
        for _ in range(6 if how == "stop request" else 5):
            request_id, result = completed.get(timeout=120)
            answers.setdefault(request_id, []).append(result)
    for result in answers["target"]:  # the stop request's answer, and the stopped request's
        assert isinstance(result, InferenceServerException)
        assert result.status() == "StatusCode.CANCELLED"
        if how == "stop request":
            assert "Request cancelled by client" in str(result)
    for k in range(4):
        [result] = answers[f"other-{k}"]
        assert result.as_numpy("text_output")[0].decode() == expected
    assert server_metrics.wait_idle(server.metrics_url, timeout=5) < 5
    m = server_metrics.metrics(server.metrics_url)
    assert aborted(server) == before + 1, m
    # cut short (the server is shared: its counters read as deltas)
    assert m["vllm:generation_tokens_total"] - generated < 4 * OTHERS_LEN + TARGET_LEN


def test_end_to_end_test_llmapi_requests(server: TritonServer, llm: LLM) -> None:
    """end_to_end_test.py --test-llmapi: text_input [1] over HTTP (its default protocol),
    `--output-config` flags as BOOL [1], `--sampling-params` with numpy's default dtypes."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    def tensor(name: str, value: np.ndarray) -> Any:
        t = httpclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        return t

    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    text_input = tensor("text_input", np.array([PROMPT], dtype=object))
    result = client.infer("tensorrt_llm", [text_input], request_id="0")
    assert result.as_numpy("text_output")[0].decode() == PROMPT + greedy(llm, PROMPT, 32)
    assert result.as_numpy("finish_reason") is None  # not asked for
    flags = [
        tensor(name, np.array([True], dtype=bool))
        for name in ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")
    ]
    stop = greedy(llm, PROMPT, 32)[8:11]
    stop_input = tensor("sampling_param_stop", np.array([stop], dtype=object))
    for extra, reason, stop_reason in [([], "length", "None"), ([stop_input], "stop", stop)]:
        result = client.infer("tensorrt_llm", [text_input, *flags, *extra], request_id="1")
        assert result.as_numpy("finish_reason").tolist() == [reason.encode()]
        assert result.as_numpy("stop_reason").tolist() == [stop_reason.encode()]
        assert result.as_numpy("cumulative_logprob").dtype == np.float32
    assert result.as_numpy("text_output")[0].decode() == PROMPT + greedy(
        llm, PROMPT, 32, stop=[stop]
    )
    # --sampling-params "{'max_tokens': 10}" sends INT64: Triton refuses it (as upstream's
    # config, which declares INT32 too)
    max_tokens = tensor("sampling_param_max_tokens", np.array([10], dtype=int))
    with pytest.raises(InferenceServerException, match="data-type is 'INT64', but model"):
        client.infer("tensorrt_llm", [text_input, max_tokens])
    # --streaming: this model is not decoupled, as upstream's default
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    streaming = llmapi_tensor("streaming", np.array([True], dtype=bool))
    with pytest.raises(InferenceServerException) as e:
        grpc.infer("tensorrt_llm", [llmapi_inputs(PROMPT, 4)[0], streaming])
    assert "Streaming is only supported in decoupled mode." in str(e.value)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    # an open keep-alive connection holds a stopping server for its whole exit timeout
    client.close()
    grpc.close()


def test_stop_by_request_id_can_be_turned_off(checkpoints: dict[str, Path]) -> None:
    """`stop_by_request_id` "false": a stop is refused, so no client stops another's request
    by guessing its id (the requests in flight are untouched)."""

    tokenizer = Tokenizer.from_model_dir(str(checkpoints["llama"]))
    for allow, stopped in ((False, False), (True, True)):
        model = LlmApiModel(tokenizer, 1 << 20, allow_stop=allow)
        victim = Run()
        model._register("1", victim)
        answer = model.stop("1")
        assert victim.stopped is stopped
        assert (answer.code == "CANCELLED") is allow
        assert allow or "stop by request id is turned off" in (answer.error or "")


def test_llmapi_beam_search(server: TritonServer, llm: LLM) -> None:
    """The LLM API's beam search (use_beam_search, best_of = width, n returned) and
    TensorRT-LLM's `beam_width`: `text_output` [n], the best n beams of `LLM.beam_search`,
    with their finish reasons and cumulative log-probs; `early_stopping` 1 / 0 / 2 as
    TensorRT-LLM's (HF's True / False / "never") on a prompt whose beams end in EOS."""
    import tritonclient.grpc as grpcclient

    def infer(prompt: str, max_tokens: int, **extra: np.ndarray) -> Any:
        flags = {f: np.array([True]) for f in ("return_finish_reason", "return_cumulative_logprob")}
        inputs = llmapi_inputs(prompt, max_tokens)
        inputs += [llmapi_tensor(k, v) for k, v in {**extra, **flags}.items()]
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            return client.infer("tensorrt_llm", inputs)

    def expected(prompt: str, params: BeamSearchParams, n: int) -> list[Any]:
        (out,) = llm.beam_search([prompt], params)
        return out.sequences[:n]

    def texts(prompt: str, seqs: list[Any]) -> list[bytes]:
        skip = len(llm.engine.tokenizer.encode(prompt))
        return [(prompt + llm.engine.tokenizer.decode(s.tokens[skip:])).encode() for s in seqs]

    best = expected(PROMPT, BeamSearchParams(3, 16), 2)
    result = infer(PROMPT, 16, **use_beams(3), sampling_param_n=np.array([2], dtype=np.int32))
    assert result.as_numpy("text_output").tolist() == texts(PROMPT, best)
    reasons = [s.finish_reason.encode() for s in best]
    assert result.as_numpy("finish_reason").tolist() == reasons
    cums = [s.cum_logprob for s in best]
    np.testing.assert_allclose(result.as_numpy("cumulative_logprob"), cums, atol=1e-4)
    result = infer(PROMPT, 16, beam_width=np.array([3], dtype=np.int32))  # n = 1: the best
    assert result.as_numpy("text_output").tolist() == texts(PROMPT, best[:1])
    answers = {}
    for value, mode in [(1, True), (0, False), (2, "never")]:
        seqs = expected(EOS_PROMPT, BeamSearchParams(2, 10, early_stopping=mode), 2)
        stop = np.array([value], dtype=np.int32)
        result = infer(
            EOS_PROMPT,
            10,
            **use_beams(2),
            sampling_param_n=np.array([2], dtype=np.int32),
            sampling_param_early_stopping=stop,
        )
        answers[value] = result.as_numpy("text_output").tolist()
        assert answers[value] == texts(EOS_PROMPT, seqs)
    assert answers[1] != answers[0]  # the setup's point: the stops differ
