"""TensorRT-LLM's BLS clients against the real server, sending exactly what its sample client
end_to_end_grpc_client.py sends to `tensorrt_llm_bls` ([1, 1] tensors over a gRPC stream,
streamed or not, `--batch-inputs` stacking prompts into [B, 1]). The oracle is the offline
engine: TensorRT-LLM decodes greedily when no top_k / top_p is sent. The adapter's rules are
checked offline first (pagedllm.serving.trtllm). The LLM-API model: test_trtllm_llmapi.py."""

from __future__ import annotations

import queue
import threading
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
from pagedllm.serving.trtllm_llmapi import llmapi_greedy
from pagedllm.text.tokenizer import Tokenizer

SHARES_SERVER = True  # conftest's session server: requests only, metrics read as deltas
PROMPT = "Once upon a time"
OTHER = "Paged attention"
OUTPUT_LEN = 12
SLOW_LEN = 2000  # tokens of conftest's slow checkpoint (no EOS before): seconds on any machine
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
        ({"beam_width": np.array([[11]], dtype=np.int32)}, r"beam_width must be in \[1, 10\]"),
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
        ("beam_width", np.int32(11), "beam_width must be in [1, 10], got 11"),
        ("num_return_sequences", np.int32(2), "num_return_sequences must be 1"),
        ("return_context_logits", True, "return_context_logits is not supported"),
        ("lora_task_id", np.uint64(3), "LoRA feature is not enabled."),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(
    server: TritonServer, name: str, value: Any, message: str
) -> None:
    tensors = prepare_inputs(PROMPT, 4, False)
    tensors[name] = np.array([[value]])
    [error] = run_inference(server, tensors)
    assert isinstance(error, Exception) and message in str(error)


def test_a_cancelled_stream_frees_its_blocks(slow_shared_server: TritonServer) -> None:
    """The cancel reaches the engine at the BLS model's next poll of its client (every 0.2 s):
    the request must still be running then. The tiny model's 480 tokens (its context is 512)
    take ~0.5 s, and under load its 5th response reached the client so late that it ended by
    length (the counters: length + 1, abort + 0); the slow checkpoint's SLOW_LEN take seconds."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    server = slow_shared_server
    before = aborted(server)
    received = threading.Semaphore(0)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: received.release())
    inputs = []
    for name, value in prepare_inputs(PROMPT, SLOW_LEN, streaming=True).items():
        inputs.append(grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    client.async_stream_infer("tensorrt_llm_bls", inputs)
    for _ in range(5):
        assert received.acquire(timeout=60)
    server_metrics.wait_running(server.metrics_url, 1, timeout=10)  # idle from now on: fresh
    client.stop_stream(cancel_requests=True)
    assert server_metrics.wait_idle(server.metrics_url, timeout=1.0) < 1.0
    assert aborted(server) == before + 1


def test_beam_width_gives_every_beam(server: TritonServer, llm: LLM) -> None:
    """[batch, beam] outputs as TensorRT-LLM's client reads them: `text_output` [beam] best
    first, `cum_log_probs` [1, beam], `output_log_probs` [1, beam, tokens]; streamed, every
    response holds every beam whole. Oracle: `LLM.beam_search`."""
    from pagedllm.beam_search import BeamSearchParams

    (beams,) = llm.beam_search([PROMPT], BeamSearchParams(3, OUTPUT_LEN))
    n = len(llm.engine.tokenizer.encode(PROMPT))
    expected = [llm.engine.tokenizer.decode(s.tokens[n:]) for s in beams.sequences]
    lengths = [len(s.tokens) - n for s in beams.sequences]
    extra = {
        "beam_width": np.array([[3]], dtype=np.int32),
        "return_log_probs": np.array([[True]]),
        "return_num_output_tokens": np.array([[True]]),
    }
    outputs = ("text_output", "cum_log_probs", "output_log_probs", "num_output_tokens")
    (result,) = run_inference(server, prepare_inputs(PROMPT, OUTPUT_LEN, False, **extra), outputs)
    assert not isinstance(result, Exception), result
    got = [t.decode() for t in result.as_numpy("text_output")]
    assert got == [PROMPT + t for t in expected]
    cums = [s.cum_logprob for s in beams.sequences]
    np.testing.assert_allclose(result.as_numpy("cum_log_probs"), [cums], atol=1e-4)
    per_token = result.as_numpy("output_log_probs")
    assert per_token.shape == (1, 3, max(lengths))  # shorter beams (ended by EOS) padded
    np.testing.assert_allclose(per_token.sum(-1), [cums], atol=1e-4)
    assert result.as_numpy("num_output_tokens").tolist() == [[n + k for k in lengths]]
    streamed = run_inference(server, prepare_inputs(PROMPT, OUTPUT_LEN, True, **extra), outputs)
    assert len(streamed) == OUTPUT_LEN
    for step, r in enumerate(streamed[:-1], 1):  # the live beams, step tokens each
        assert not isinstance(r, Exception), r
        assert r.as_numpy("output_log_probs").shape == (1, 3, step)
    assert [t.decode() for t in streamed[-1].as_numpy("text_output")] == expected
