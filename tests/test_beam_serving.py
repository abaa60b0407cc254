"""Beam search through Triton (`beam_width` on `ensemble` and `llm`, `serving.beams`) on the
real server. Oracle: `LLM.beam_search` on the same checkpoint, an independent engine run."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from test_contract import generate
from test_trtllm_bls import greedy, prepare_inputs, run_inference, stack

from pagedllm import LLM
from pagedllm.beam_search import BeamSearchParams
from pagedllm.serving.tritonserver import TritonServer

SHARES_SERVER = True  # conftest's session server: requests only
PROMPT = "Once upon a time"
WIDTH, STEPS = 3, 6


def expected(llm: LLM, length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """The oracle's beams, best first: (output token ids, cumulative log-prob)."""
    params = BeamSearchParams(WIDTH, STEPS, ignore_eos=True, length_penalty=length_penalty)
    (out,) = llm.beam_search([PROMPT], params)
    prompt = llm.engine.tokenizer.encode(PROMPT)
    return [(s.tokens[len(prompt) :], s.cum_logprob) for s in out.sequences]


def values(**extra: Any) -> dict[str, Any]:
    return {
        "text_input": PROMPT,
        "max_tokens": STEPS,
        "ignore_eos": True,
        "beam_width": np.array([WIDTH], dtype=np.int32),
        **extra,
    }


def check_beams(
    llm: LLM, response: dict[str, np.ndarray], beams: list[tuple[list[int], float]], prefix: str
) -> None:
    lengths = response["sequence_lengths"].tolist()
    assert lengths == [len(ids) for ids, _ in beams]
    ids = response["output_token_ids"].tolist()
    starts = np.cumsum([0, *lengths])
    assert [ids[a:b] for a, b in pairwise(starts)] == [i for i, _ in beams]
    decode = llm.engine.tokenizer.decode
    assert [t.decode() for t in response["text_output"]] == [prefix + decode(i) for i, _ in beams]
    np.testing.assert_allclose(response["cum_log_probs"], [c for _, c in beams], atol=1e-4)
    per_beam = np.split(response["output_log_probs"], starts[1:-1])
    np.testing.assert_allclose([p.sum() for p in per_beam], [c for _, c in beams], atol=1e-4)


@pytest.mark.parametrize("model", ["ensemble", "llm"])
def test_beams_equal_the_offline_beam_search(server: TritonServer, llm: LLM, model: str) -> None:
    beams = expected(llm)
    assert len({tuple(i) for i, _ in beams}) == WIDTH
    (response,) = generate(server, values(), model=model)
    check_beams(llm, response, beams, PROMPT)
    assert response["finish_reason"].tolist() == [b"length"] * WIDTH
    (excluded,) = generate(server, values(exclude_input_in_output=True), model=model)
    check_beams(llm, excluded, beams, "")


def test_length_penalty_is_served(server: TritonServer, llm: LLM) -> None:
    beams = expected(llm, length_penalty=0.5)
    lp = np.array([0.5], dtype=np.float32)
    (response,) = generate(server, values(length_penalty=lp, exclude_input_in_output=True))
    check_beams(llm, response, beams, "")


def test_streamed_responses_carry_every_beam_whole(server: TritonServer, llm: LLM) -> None:
    responses = generate(server, values(stream=True))
    assert len(responses) == STEPS  # one per step, the last the final ranking
    for step, response in enumerate(responses, 1):
        assert response["sequence_lengths"].tolist() == [step] * WIDTH
        texts = response["text_output"].tolist()
        ids = response["output_token_ids"].reshape(WIDTH, step).tolist()
        assert texts == [llm.engine.tokenizer.decode(i).encode() for i in ids]
        cums = response["cum_log_probs"].tolist()
        assert cums == sorted(cums, reverse=True)  # best first
    check_beams(llm, responses[-1], expected(llm), "")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"beam_width": np.array([11], dtype=np.int32)}, r"beam_width must be in \[1, 10\]"),
        ({"stop_words": ["the"]}, "cannot be combined with stop strings"),
        ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a+"}, "structured"),
        ({"top_logprobs": 2}, "cannot be combined with top log-probs"),
    ],
)
def test_what_beams_cannot_serve_is_refused(
    server: TritonServer, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        generate(server, values(**extra))


# a prompt where the tiny checkpoint's beams of width 2 end in its EOS: with early_stopping
# True the search stops after 6 tokens, with False it runs to 10 (`LLM.beam_search` is HF's
# there: tests/test_beam_early_stopping.py)
EOS_PROMPT = "cndwrublnhddr"


def offline_beams(llm: LLM, stop: bool | None) -> list[tuple[list[int], float]]:
    params = BeamSearchParams(2, 10, early_stopping=stop)
    (out,) = llm.beam_search([EOS_PROMPT], params)
    n = len(llm.engine.tokenizer.encode(EOS_PROMPT))
    return [(s.tokens[n:], s.cum_logprob) for s in out.sequences]


def test_early_stopping_is_served(server: TritonServer, llm: LLM) -> None:
    """TensorRT-LLM's `early_stopping` (BOOL) runs HF's rule with that stop, on `ensemble` and
    `tensorrt_llm_bls` (end_to_end_grpc_client.py's request, `early_stopping` added)."""
    got = {}
    for stop in (True, False, None):
        beams = offline_beams(llm, stop)
        got[stop] = [ids for ids, _ in beams]
        extra = {} if stop is None else {"early_stopping": stop}
        inputs = {"text_input": EOS_PROMPT, "max_tokens": 10, "beam_width": 2, **extra}
        (response,) = generate(server, {**inputs, "return_log_probs": True})
        check_beams(llm, response, beams, EOS_PROMPT)
        bls = {k: np.array([[v]]) for k, v in extra.items()}
        bls["beam_width"] = np.array([[2]], dtype=np.int32)
        (result,) = run_inference(server, prepare_inputs(EOS_PROMPT, 10, False, **bls))
        texts = [t.decode() for t in result.as_numpy("text_output")]
        assert texts == [EOS_PROMPT + llm.engine.tokenizer.decode(ids) for ids, _ in beams]
    assert max(len(ids) for ids in got[True]) == 6  # the setup's point: the stops differ
    assert got[True] != got[False] != got[None]


def client_texts(results: list[Any], batch_size: int, beam_width: int) -> list[str]:
    """end_to_end_grpc_client.run_inference's parsing with beam_width > 1: each response's
    `text_output[0]` (its best beam) put at [batch_index][sequence_index] (0 when absent),
    streamed or not; the other generations stay ""."""
    out = [[""] * beam_width for _ in range(batch_size)]
    for result in results:
        assert not isinstance(result, Exception), result
        batch_index, seq_index = (result.as_numpy(n) for n in ("batch_index", "sequence_index"))
        b = 0 if batch_index is None else batch_index[0][0]
        s = 0 if seq_index is None else seq_index[0][0]
        out[b][s] = result.as_numpy("text_output")[0].decode("utf-8")
    return [text for texts in out for text in texts]


def test_end_to_end_grpc_client_beam_width_2(server: TritonServer, llm: LLM) -> None:
    """TensorRT-LLM's end_to_end_grpc_client.py --beam-width 2 --model-name tensorrt_llm_bls
    (its own requests: test_trtllm_bls.prepare_inputs), not streamed, streamed (-S) and
    --batch-inputs: it reads the best beam of `LLM.beam_search`."""
    prompts = [PROMPT, "Paged attention"]
    params = BeamSearchParams(2, STEPS)
    best = {}
    for prompt, out in zip(prompts, llm.beam_search(prompts, params), strict=True):
        n = len(llm.engine.tokenizer.encode(prompt))
        best[prompt] = llm.engine.tokenizer.decode(out.sequences[0].tokens[n:])
    assert all(best[p] != greedy(llm, p, STEPS) for p in prompts)  # beams, not greedy
    width = {"beam_width": np.array([[2]], dtype=np.int32)}
    results = run_inference(server, prepare_inputs(PROMPT, STEPS, False, **width))
    assert client_texts(results, 1, 2) == [PROMPT + best[PROMPT], ""]
    streamed = run_inference(server, prepare_inputs(PROMPT, STEPS, True, **width))
    assert len(streamed) == STEPS  # each the beams so far, whole: the last the final ranking
    assert client_texts(streamed, 1, 2) == [best[PROMPT], ""]
    batch = stack(*(prepare_inputs(p, STEPS, False, **width) for p in prompts))
    results = run_inference(server, batch, outputs=("text_output", "batch_index"))
    assert client_texts(results, 2, 2) == [
        PROMPT + best[PROMPT],
        "",
        prompts[1] + best[prompts[1]],
        "",
    ]
