"""TensorRT-LLM's clients against the real server, sending exactly what its sample clients send:
end_to_end_grpc_client.py to `tensorrt_llm_bls` ([1, 1] tensors over a gRPC stream, streamed
or not, `--batch-inputs` stacking prompts into [B, 1]); llmapi_client.py to `tensorrt_llm` (the
LLM-API model: unary `async_infer`, its stop request, its cancel) and end_to_end_test.py
--test-llmapi's request (HTTP `infer`). The oracle is the offline engine: TensorRT-LLM decodes
greedily when no top_k / top_p is sent (the BLS) or no sampling parameter at all (the LLM API).
The adapters' rules are checked offline first (pagedllm.serving.trtllm, trtllm_llmapi)."""

from __future__ import annotations

import queue
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import server_metrics

from pagedllm import LLM, SamplingParams
from pagedllm.serving.codec import RequestError
from pagedllm.serving.tritonserver import TritonServer
from pagedllm.serving.trtllm import BatchReplies, BlsModel, trt_greedy, words
from pagedllm.serving.trtllm_llmapi import LlmApiModel, llmapi_greedy
from pagedllm.text.tokenizer import Tokenizer

PROMPT = "Once upon a time"
OTHER = "Paged attention"
OUTPUT_LEN = 12
LONG = 480  # tokens: about a second alone on the tiny model (its context is 512)
ABORTED = "vllm:request_success_total{finished_reason=abort}"


def greedy(llm: LLM, prompt: str, max_tokens: int, stream: bool = False, **params: Any) -> str:
    """The offline engine's greedy text (EOS honoured, as TensorRT-LLM), or its streamed
    deltas joined."""
    from test_server import offline_text

    return offline_text(
        llm, prompt, stream=stream, max_tokens=max_tokens, ignore_eos=False, **params
    )


def aborted(server: TritonServer) -> float:
    return server_metrics.metrics(server.metrics_url).get(ABORTED, 0.0)


# --- end_to_end_grpc_client.py ------------------------------------------------------------------


def prepare_inputs(
    prompt: str, output_len: int, streaming: bool, **extra: np.ndarray
) -> dict[str, np.ndarray]:
    """end_to_end_grpc_client.prepare_inputs with its defaults (temperature 1.0, no top_k /
    top_p, exclude_input_in_output always sent)."""
    input0 = [[prompt]]
    return {
        "text_input": np.array(input0).astype(object),
        "max_tokens": np.ones_like(input0).astype(np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        **extra,
        "exclude_input_in_output": np.array([[False]], dtype=bool),
    }


def run_inference(
    server: TritonServer,
    inputs: dict[str, np.ndarray],
    outputs: tuple[str, ...] = ("text_output",),
    request_id: str = "",
) -> list[Any]:
    """As end_to_end_grpc_client.run_inference: one request on a gRPC stream, stop_stream()
    (which waits for the stream to end), then every result or error received."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    def prepare_tensor(name: str, value: np.ndarray) -> Any:
        t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        return t

    completed: queue.Queue[Any] = queue.Queue()

    def callback(user_data: queue.Queue[Any], result: Any, error: Any) -> None:
        user_data.put(error if error else result)

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(callback, completed))
    client.async_stream_infer(
        "tensorrt_llm_bls",
        [prepare_tensor(k, v) for k, v in inputs.items()],
        outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
        request_id=request_id,
    )
    client.stop_stream()
    return [completed.get() for _ in range(completed.qsize())]


def texts(results: list[Any], batch_size: int = 1, streaming: bool = False) -> list[str]:
    """The client's parsing: batch_index read as [0][0] (0 when absent); streamed texts
    appended."""
    out = [""] * batch_size
    for result in results:
        assert not isinstance(result, Exception), result
        batch_index = result.as_numpy("batch_index")
        index = 0 if batch_index is None else batch_index[0][0]
        text = result.as_numpy("text_output")[0].decode("utf-8")
        out[index] = out[index] + text if streaming else text
    return out


def delivered(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors as the model receives them: BYTES elements as bytes."""

    def encode(a: np.ndarray) -> np.ndarray:
        return np.vectorize(lambda v: v.encode() if isinstance(v, str) else v, otypes=[object])(a)

    return {k: encode(v) if v.dtype == object else v for k, v in tensors.items()}


def generated_tokens(llm: LLM, prompt: str, max_tokens: int) -> int:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return len(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def stack(*requests: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """--batch-inputs: each tensor concatenated along axis 0."""
    return {k: np.concatenate([r[k] for r in requests], axis=0) for k in requests[0]}


# --- the adapters' rules, offline ---------------------------------------------------------------


def test_tensorrt_llm_sampling_defaults() -> None:
    def after(rule: Any, **values: Any) -> dict[str, Any]:
        inputs = {k: np.array([v]) for k, v in values.items()}
        rule(inputs)
        return {k: v.item() for k, v in inputs.items()}

    # BLS: greedy unless top_k or top_p is above 0; values <= 0 are unset
    assert after(trt_greedy, temperature=1.0) == {"temperature": 0.0}
    assert after(trt_greedy, temperature=1.0, top_k=0, top_p=0.0) == {"temperature": 0.0}
    assert after(trt_greedy, temperature=0.7, top_k=5, top_p=0.0) == {
        "temperature": 0.7,
        "top_k": 5,
    }
    assert after(trt_greedy, top_k=0, top_p=0.9) == {"top_p": pytest.approx(0.9)}
    # LLM API: greedy when nothing is set, or top_k 1, top_p 0, temperature 0
    assert after(llmapi_greedy) == {"temperature": 0.0}
    assert after(llmapi_greedy, top_k=1, top_p=0.5) == {"temperature": 0.0}
    assert after(llmapi_greedy, temperature=0.8) == {"temperature": pytest.approx(0.8)}
    assert after(llmapi_greedy, top_p=0.0, temperature=1.0) == {"temperature": 0.0}
    # empty words are skipped (the clients' "no words" is [[""]])
    assert words({"w": np.array([[b""]], dtype=object)}.get, "w") is None
    kept = words({"w": np.array([[b"a", b"", b"b c"]], dtype=object)}.get, "w")
    assert kept is not None and kept.tolist() == [b"a", b"b c"]


def test_bls_items_split_the_batch_and_refuse_what_cannot_be_served(
    checkpoints: dict[str, Path],
) -> None:
    model = BlsModel(Tokenizer.from_model_dir(checkpoints["llama"]), 1 << 20)
    request = delivered(stack(prepare_inputs(PROMPT, 5, False), prepare_inputs(OTHER, 7, True)))
    items = model.items(request.get)
    assert [i.index for i in items] == [0, 1] and all(i.batched for i in items)
    assert [i.stream for i in items] == [False, True]
    assert items[1].inputs["max_tokens"].tolist() == [7]
    assert items[1].inputs["temperature"].tolist() == [0.0]  # no top_k / top_p: greedy
    assert not model.items(delivered(prepare_inputs(PROMPT, 5, False)).get)[0].batched
    refused = [
        ({"beam_width": np.array([[2]], dtype=np.int32)}, "beam_width must be 1"),
        ({"num_return_sequences": np.array([[2]], dtype=np.int32)}, "num_return_sequences"),
        ({"return_perf_metrics": np.array([[True]])}, "return_perf_metrics is not supported"),
        ({"return_generation_logits": np.array([[True]])}, "return_generation_logits is not"),
        ({"max_tokens": np.array([[5], [5]], dtype=np.int32)}, "batch sizes differ"),
    ]
    for extra, message in refused:
        with pytest.raises(RequestError, match=message):
            model.items(delivered({**prepare_inputs(PROMPT, 5, False), **extra}).get)


def test_batch_replies_send_one_final_and_stop_at_the_first_error() -> None:
    sent: list[Any] = []
    replies = BatchReplies(
        2,
        send=lambda t: sent.append(t),
        fail=lambda message, code: sent.append((message, code)),
        finish=lambda: sent.append("final"),
        is_cancelled=lambda: False,
    )
    replies.send({"a": np.zeros(1)})
    replies.item_done()
    assert not replies.cancelled() and sent[-1] != "final"
    replies.item_done()
    assert sent[-1] == "final" and replies.cancelled()  # never asks the sender after it
    failing = BatchReplies(
        2, sent.append, lambda m, c: sent.append(m), lambda: sent.append("x"), bool
    )
    failing.fail("bad", "INVALID_ARG")
    failing.fail("worse", "INTERNAL")
    failing.send({"late": np.zeros(1)})
    failing.item_done()
    failing.item_done()
    assert sent[-1] == "bad" and failing.cancelled()  # the other items abort


def test_llmapi_request_defaults_and_refusals(checkpoints: dict[str, Path]) -> None:
    model = LlmApiModel(Tokenizer.from_model_dir(checkpoints["llama"]), 1 << 20)
    text = {"text_input": np.array([PROMPT.encode()], dtype=object)}
    request = model.request(text.get)
    assert request.inputs["max_tokens"].tolist() == [32]  # the LLM API's default
    assert request.inputs["temperature"].tolist() == [0.0]
    for extra, message in [
        ({"sampling_param_best_of": np.array([2], dtype=np.int32)}, "best_of must be 1"),
        ({"sampling_param_return_perf_metrics": np.array([True])}, "not supported"),
        ({"text_input": np.array([], dtype=object)}, "text_input is missing"),
    ]:
        with pytest.raises(RequestError, match=message):
            model.request({**text, **extra}.get)
    assert model.stop("").error == "A request id must be provided for request cancellation"
    assert model.stop("nobody").code == "CANCELLED"  # stopping nothing is answered alike


# --- tensorrt_llm_bls ---------------------------------------------------------------------------


def test_end_to_end_grpc_client_streamed_and_not(server: TritonServer, llm: LLM) -> None:
    results = run_inference(server, prepare_inputs(PROMPT, OUTPUT_LEN, streaming=False))
    assert len(results) == 1  # one response (the final flag comes alone, unseen)
    assert texts(results) == [PROMPT + greedy(llm, PROMPT, OUTPUT_LEN)]
    assert results[0].as_numpy("text_output").shape == (1,)  # [beam], as upstream
    results = run_inference(server, prepare_inputs(PROMPT, OUTPUT_LEN, streaming=True))
    # one response per token, with its new text
    assert len(results) == generated_tokens(llm, PROMPT, OUTPUT_LEN)
    assert texts(results, streaming=True) == [greedy(llm, PROMPT, OUTPUT_LEN, stream=True)]


def test_batch_inputs_are_separate_engine_requests(server: TritonServer, llm: LLM) -> None:
    for streaming in (False, True):
        batch = stack(
            prepare_inputs(PROMPT, OUTPUT_LEN, streaming), prepare_inputs(OTHER, 5, streaming)
        )
        results = run_inference(server, batch, outputs=("text_output", "batch_index"))
        tokens = generated_tokens(llm, PROMPT, OUTPUT_LEN) + generated_tokens(llm, OTHER, 5)
        assert len(results) == (tokens if streaming else 2)
        expected = [
            greedy(llm, PROMPT, OUTPUT_LEN, stream=streaming),
            greedy(llm, OTHER, 5, stream=streaming),
        ]
        if not streaming:
            expected = [PROMPT + expected[0], OTHER + expected[1]]
        assert texts(results, batch_size=2, streaming=streaming) == expected
    # a single prompt's responses carry no batch_index (TensorRT-LLM's rule)
    one = run_inference(server, prepare_inputs(PROMPT, 2, False), ("text_output", "batch_index"))
    assert one[0].as_numpy("batch_index") is None


def test_log_probs_and_token_counts(server: TritonServer, llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, logprobs=0)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    expected = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs or []]
    flags = {
        name: np.array([[True]], dtype=bool)
        for name in ("return_log_probs", "return_num_input_tokens", "return_num_output_tokens")
    }
    names: tuple[str, ...] = ("text_output", "cum_log_probs", "output_log_probs")
    names += ("num_input_tokens", "num_output_tokens")
    [result] = run_inference(server, prepare_inputs(PROMPT, OUTPUT_LEN, False, **flags), names)
    log_probs = result.as_numpy("output_log_probs")
    assert log_probs.shape == (1, 1, len(expected))  # [batch, beam, tokens]
    assert log_probs[0, 0].tolist() == pytest.approx(expected, abs=1e-4)
    assert result.as_numpy("cum_log_probs").shape == (1, 1)
    assert result.as_numpy("cum_log_probs")[0, 0] == pytest.approx(sum(expected), abs=1e-3)
    prompt_len, generated = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    assert result.as_numpy("num_input_tokens").tolist() == [[prompt_len]]
    # not streamed and the prompt not excluded: TensorRT-LLM counts the prompt's ids too
    assert result.as_numpy("num_output_tokens").tolist() == [[prompt_len + generated]]
    streamed = run_inference(server, prepare_inputs(PROMPT, OUTPUT_LEN, True, **flags), names)
    assert [r.as_numpy("num_output_tokens")[0, 0] for r in streamed] == [1] * generated
    joined = np.concatenate([r.as_numpy("output_log_probs")[0, 0] for r in streamed])
    assert joined.tolist() == pytest.approx(expected, abs=1e-4)


def test_stop_words_and_the_clients_empty_word_lists(server: TritonServer, llm: LLM) -> None:
    full = greedy(llm, PROMPT, 24)
    stop = full[8:11]
    cut = greedy(llm, PROMPT, 24, stop=[stop])
    assert cut == full[: full.index(stop)]
    stop_words = np.array([[stop]], dtype=object)
    results = run_inference(server, prepare_inputs(PROMPT, 24, True, stop_words=stop_words))
    assert texts(results, streaming=True) == [greedy(llm, PROMPT, 24, stream=True, stop=[stop])]
    # end_to_end_test.py sends [[""]] for no words: nothing is banned or stopped on
    empty = {n: np.array([[""]], dtype=object) for n in ("bad_words", "stop_words")}
    results = run_inference(server, prepare_inputs(PROMPT, 24, False, **empty))
    assert texts(results) == [PROMPT + full]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("beam_width", np.int32(2), "beam_width must be 1 (beam search is not supported), got 2"),
        ("num_return_sequences", np.int32(2), "num_return_sequences must be 1"),
        ("return_context_logits", True, "return_context_logits is not supported"),
        ("lora_task_id", np.uint64(3), "unexpected inference input 'lora_task_id'"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(
    server: TritonServer, name: str, value: Any, message: str
) -> None:
    tensors = prepare_inputs(PROMPT, 4, False)
    tensors[name] = np.array([[value]])
    [error] = run_inference(server, tensors)
    assert isinstance(error, Exception) and message in str(error)


def test_a_cancelled_stream_frees_its_blocks(server: TritonServer) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    before = aborted(server)
    received = threading.Semaphore(0)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: received.release())
    inputs = []
    for name, value in prepare_inputs(PROMPT, LONG, streaming=True).items():
        inputs.append(grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    client.async_stream_infer("tensorrt_llm_bls", inputs)
    for _ in range(5):
        assert received.acquire(timeout=60)
    client.stop_stream(cancel_requests=True)
    assert server_metrics.wait_idle(server.metrics_url, timeout=1.0) < 1.0
    assert aborted(server) == before + 1


# --- tensorrt_llm (the LLM-API model) -----------------------------------------------------------


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
def test_llmapi_client_stops_a_request(server: TritonServer, llm: LLM, how: str) -> None:
    """llmapi_client.py --stop-after-ms (a stop request with the same request id, or
    --stop-via-request-cancel): the request ends as CANCELLED and its engine request is
    aborted; requests under other ids run on untouched. The others also slow the engine, so
    the target is still running at its first probe (0.5 s)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    params = SamplingParams(temperature=0, max_tokens=LONG)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"  # no EOS: it runs for a while
    expected = PROMPT + out.text
    before = aborted(server)
    completed: queue.Queue[tuple[str, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:

        def send(request_id: str, inputs: list[Any]) -> Any:
            def callback(result: Any, error: Any) -> None:
                completed.put((request_id, error or result))

            return client.async_infer(
                "tensorrt_llm", inputs, request_id=request_id, callback=callback
            )

        for k in range(4):
            send(f"other-{k}", llmapi_inputs(PROMPT, LONG))
        future = send("target", llmapi_inputs(PROMPT, LONG))
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
    assert aborted(server) == before + 1


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


def test_stop_by_request_id_can_be_turned_off(checkpoints: dict[str, Path]) -> None:
    """`stop_by_request_id` "false": a stop is refused, so no client stops another's request
    by guessing its id (the requests in flight are untouched)."""
    from pagedllm.serving.trtllm_llmapi import Run

    tokenizer = Tokenizer.from_model_dir(str(checkpoints["llama"]))
    for allow, stopped in ((False, False), (True, True)):
        model = LlmApiModel(tokenizer, 1 << 20, allow_stop=allow)
        victim = Run()
        model._register("1", victim)
        answer = model.stop("1")
        assert victim.stopped is stopped
        assert (answer.code == "CANCELLED") is allow
        assert allow or "stop by request id is turned off" in (answer.error or "")
