"""The client contract's newer rows on the real server (docs/serving.md, the contract table):
top-N and prompt log-probs, prompts as token ids, TensorRT-LLM's input names and
vllm_backend's optional outputs. Oracle: the offline engine on the same checkpoint (its
log-probs are checked against HF transformers in test_logprobs_oracle.py) and the
tokenizer's own decode."""

from __future__ import annotations

import json
import queue
from typing import Any

import numpy as np
import pytest
from grpc_stream import grpc_inputs

from pagedllm import LLM, SamplingParams
from pagedllm.serving.tritonserver import TritonServer

SHARES_SERVER = True  # conftest's session server: requests only, metrics read as deltas
PROMPT = "Once upon a time"
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


def generate(
    server: TritonServer, values: dict[str, Any], model: str = "ensemble"
) -> list[dict[str, np.ndarray]]:
    """Every response of one gRPC streaming request, as {output name: array}; an error
    raises RuntimeError with its message."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, grpc_inputs(values), enable_empty_final_response=True)
    responses = []
    try:
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise RuntimeError(str(error.message()))
            response = result.get_response()
            names = [o.name for o in response.outputs]
            if names:
                responses.append({n: result.as_numpy(n) for n in names})
            if response.parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()


def offline(llm: LLM, prompt: str | list[int] = PROMPT, **params: Any) -> Any:
    sampling = SamplingParams(**{**GREEDY, **params})
    if isinstance(prompt, list):
        return llm.generate({"prompt_token_ids": prompt}, sampling, use_tqdm=False)[0]
    return llm.generate(prompt, sampling, use_tqdm=False)[0]


def best(entries: Any, n: int) -> tuple[list[list[int]], list[list[float]]]:
    """The offline output's top n (ids, log-probs) per position, best first."""
    ranked = [sorted(d.items(), key=lambda kv: kv[1].rank)[:n] for d in entries]
    return [[t for t, _ in r] for r in ranked], [[lp.logprob for _, lp in r] for r in ranked]


def joined(responses: list[dict[str, np.ndarray]], name: str) -> np.ndarray:
    return np.concatenate([r[name] for r in responses])


def test_top_logprobs_streamed_per_token(server: TritonServer, llm: LLM) -> None:
    expected = offline(llm, max_tokens=8, logprobs=5).outputs[0]
    responses = generate(
        server, {"text_input": PROMPT, "max_tokens": 8, "top_logprobs": 5, "stream": True, **GREEDY}
    )
    assert len(responses) == 8  # one per token, each with its own log-probs
    ids = joined(responses, "output_token_ids")
    assert ids.tolist() == expected.token_ids
    chosen = [next(iter(d.values())).logprob for d in expected.logprobs]
    assert joined(responses, "output_log_probs") == pytest.approx(chosen, abs=1e-5)
    top_ids, top_values = best(expected.logprobs, 5)
    assert joined(responses, "output_top_token_ids").tolist() == top_ids
    assert joined(responses, "output_top_log_probs") == pytest.approx(np.array(top_values), 1e-5)
    texts = [t.decode() for t in joined(responses, "output_tokens")]
    assert texts == [llm.engine.tokenizer.decode([i], False) for i in ids]
    top_texts = joined(responses, "output_top_tokens")
    assert top_texts.shape == (8, 5)
    assert top_texts[3, 1].decode() == llm.engine.tokenizer.decode([top_ids[3][1]], False)
    assert responses[-1]["cum_log_probs"] == pytest.approx([sum(chosen)], abs=1e-4)


@pytest.mark.parametrize("model", ["ensemble", "llm"])
def test_prompt_logprobs(server: TritonServer, llm: LLM, model: str) -> None:
    expected = offline(llm, max_tokens=3, logprobs=2, prompt_logprobs=2)
    values = {"text_input": PROMPT, "max_tokens": 3, "top_logprobs": 2, **GREEDY}
    (response,) = generate(server, {**values, "return_prompt_log_probs": True}, model)
    prompt_ids = llm.engine.tokenizer.encode(PROMPT)
    assert response["prompt_token_ids"].tolist() == prompt_ids
    scored = expected.prompt_logprobs[1:]
    assert response["prompt_log_probs"] == pytest.approx(
        [d[t].logprob for d, t in zip(scored, prompt_ids[1:], strict=True)], abs=1e-5
    )
    top_ids, top_values = best(scored, 2)
    assert response["prompt_top_token_ids"].tolist() == top_ids
    assert response["prompt_top_log_probs"] == pytest.approx(np.array(top_values), abs=1e-5)
    assert [t.decode() for t in response["prompt_tokens"]] == [
        llm.engine.tokenizer.decode([i], False) for i in prompt_ids
    ]
    # not asked: none of it
    (plain,) = generate(server, values, model)
    assert "prompt_log_probs" not in plain and "output_top_token_ids" in plain


def test_prompt_as_token_ids(server: TritonServer, llm: LLM) -> None:
    ids = [5, 17, 300, 42, 9]
    expected = offline(llm, ids, max_tokens=6)
    prompt_ids = np.array(ids, dtype=np.int32)
    (response,) = generate(server, {"input_ids": prompt_ids, "max_tokens": 6, **GREEDY})
    assert response["output_token_ids"].tolist() == expected.outputs[0].token_ids
    # a non-streamed output starts with the prompt: here the ids' text
    prompt_text = llm.engine.tokenizer.decode(ids)
    assert response["text_output"][0].decode() == prompt_text + expected.outputs[0].text
    with pytest.raises(RuntimeError, match=r"input_ids\[1\] = -5 is not a token id"):
        generate(server, {"input_ids": np.array([5, -5], dtype=np.int32), "max_tokens": 2})
    with pytest.raises(RuntimeError, match=r"prompt token ids must be in \[0, "):
        generate(server, {"input_ids": np.array([5, 10**6], dtype=np.int32), "max_tokens": 2})


def test_tensorrt_llm_names(server: TritonServer, llm: LLM) -> None:
    """What genai-perf --backend tensorrtllm and TensorRT-LLM's clients send."""
    n = 20
    values = {"text_input": PROMPT, "exclude_input_in_output": True, "temperature": 0.0}
    exact = {**values, "max_tokens": n, "min_length": n, "stream": True, "beam_width": 1}
    responses = generate(server, exact)
    assert len(joined(responses, "output_token_ids")) == n
    # end_id: the one token that ends the output (as a stop token: its text is not shown)
    free = offline(llm, max_tokens=n).outputs[0]
    end = free.token_ids[4]
    first = free.token_ids.index(end)
    (response,) = generate(server, {**values, "max_tokens": n, "end_id": end, "pad_id": 0})
    assert response["output_token_ids"].tolist() == free.token_ids[: first + 1]
    assert response["finish_reason"][0] == b"stop"
    # bad_words: banned token sequences (the word as is and after a space, as vLLM)
    word = llm.engine.tokenizer.decode([free.token_ids[2]])
    banned = offline(llm, max_tokens=n, bad_words=[word]).outputs[0]
    (response,) = generate(server, {**values, "max_tokens": n, "bad_words": [word]})
    assert response["output_token_ids"].tolist() == banned.token_ids != free.token_ids
    # random_seed is seed; num_return_sequences 1 is n = 1; length_penalty scores beams only
    sampled = {"text_input": PROMPT, "max_tokens": 8, "temperature": 1.0}
    seed = np.array([7], dtype=np.uint64)
    (a,) = generate(server, {**sampled, "random_seed": seed, "num_return_sequences": 1})
    (b,) = generate(server, {**sampled, "seed": seed, "length_penalty": 2.0})
    assert a["output_token_ids"].tolist() == b["output_token_ids"].tolist()
    refused: list[tuple[dict[str, Any], str]] = [
        ({"beam_width": 11}, r"beam_width must be in \[1, 10\]"),
        ({"return_context_logits": True}, "return_context_logits is not supported"),
        ({"min_tokens": 2, "min_length": 3}, "min_tokens and min_length disagree"),
        ({"end_id": -2}, "end_id must be a token id or -1"),
    ]
    for bad, message in refused:
        with pytest.raises(RuntimeError, match=message):
            generate(server, {**values, "max_tokens": 4, **bad})


VLLM_FLAGS = [
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
]


def test_vllm_backend_optional_outputs(server: TritonServer, llm: LLM) -> None:
    expected = offline(llm, max_tokens=6, logprobs=2).outputs[0]
    params = json.dumps({"max_tokens": 6, "logprobs": 2, **GREEDY})
    values = {"text_input": PROMPT, "sampling_parameters": params, "stream": True}
    responses = generate(server, {**values, **dict.fromkeys(VLLM_FLAGS, True)})
    names = {"text_output", "finish_reason", "cumulative_logprob", "logprobs"}
    names |= {"num_input_tokens", "num_output_tokens"}
    assert all(r.keys() == names for r in responses)
    assert [r["finish_reason"][0] for r in responses] == [b"None"] * 5 + [b"length"]
    assert all(r["num_output_tokens"].tolist() == [1] for r in responses)  # this response's
    assert responses[0]["num_input_tokens"].dtype == np.uint32
    entries = [e for r in responses for e in json.loads(r["logprobs"][0])]
    assert len(entries) == 6
    for entry, token, d in zip(entries, expected.token_ids, expected.logprobs, strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(d[token].logprob, abs=1e-5)
        assert {int(k): v["rank"] for k, v in entry.items()} == {t: lp.rank for t, lp in d.items()}
        assert entry[str(token)]["decoded_token"] == llm.engine.tokenizer.decode([token], False)
    chosen = [d[t].logprob for t, d in zip(expected.token_ids, expected.logprobs, strict=True)]
    assert responses[-1]["cumulative_logprob"] == pytest.approx([sum(chosen)], abs=1e-4)
    # flags sent false: text_output alone, as vllm_backend; logprobs "null" when not asked
    (plain,) = generate(server, {"text_input": PROMPT, **dict.fromkeys(VLLM_FLAGS, False)})
    assert plain.keys() == {"text_output"}
    (only,) = generate(server, {"text_input": PROMPT, "return_logprobs": True})
    assert only.keys() == {"text_output", "logprobs"} and only["logprobs"][0] == b"null"


def test_n_sequences_through_the_ensemble(server: TritonServer, llm: LLM) -> None:
    import server_metrics

    sampled = {"temperature": 1.0, "seed": 5, "max_tokens": 6, "n": 3, "ignore_eos": True}
    expected = llm.generate(PROMPT, SamplingParams(**sampled), use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in expected}) > 1  # different samples
    values = {"text_input": PROMPT, "sampling_parameters": json.dumps(sampled)}
    before = server_metrics.metrics(server.metrics_url).get("vllm:request_params_n_sum", 0)
    # not streamed: one response, one element per sequence
    (response,) = generate(server, values)
    assert [t.decode() for t in response["text_output"]] == [PROMPT + c.text for c in expected]
    assert response["output_token_ids"].tolist() == [t for c in expected for t in c.token_ids]
    assert response["sequence_lengths"].tolist() == response["num_output_tokens"].tolist()
    assert response["num_output_tokens"].tolist() == [6, 6, 6]
    assert [f.decode() for f in response["finish_reason"]] == ["length"] * 3
    # streamed: each response is about one sequence
    responses = generate(server, {**values, "stream": True})
    for c in expected:
        mine = [r for r in responses if r["sequence_index"].tolist() == [c.index]]
        assert "".join(r["text_output"][0].decode() for r in mine) == c.text
        assert mine[-1]["finish_reason"][0] == b"length"
    # num_return_sequences is n, and vllm_backend's outputs have one element per sequence
    trt = {"text_input": PROMPT, "max_tokens": 6, "temperature": 1.0, "num_return_sequences": 3}
    seed = {"random_seed": np.array([5], dtype=np.uint64), "ignore_eos": True}
    (same,) = generate(server, {**trt, **seed})
    assert same["text_output"].tolist() == response["text_output"].tolist()
    flags = dict.fromkeys(VLLM_FLAGS, True)
    logprobs = json.dumps({**sampled, "logprobs": 1})
    (vllm,) = generate(server, {**values, "sampling_parameters": logprobs, **flags})
    assert vllm["finish_reason"].tolist() == [b"length"] * 3
    assert vllm["num_output_tokens"].tolist() == [6, 6, 6]
    assert [len(json.loads(j)) for j in vllm["logprobs"]] == [6, 6, 6]
    assert len(vllm["cumulative_logprob"]) == 3
    after = server_metrics.metrics(server.metrics_url)["vllm:request_params_n_sum"]
    assert after - before == 3 * 4  # n observed once per request (4 requests with n = 3)
