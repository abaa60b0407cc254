"""The offline engine refuses `logit_bias` and `allowed_token_ids` naming a token id outside
the model's vocabulary (config.json's vocab_size: rows of its logits), as the gateway and the
Triton model do: a ValueError naming the id, and nothing queued. Ids inside it still run."""

from __future__ import annotations

import re

import pytest

from conftest import TINY
from pagedllm import LLM, SamplingParams

V = TINY["vocab_size"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"logit_bias": {V: 5.0}}, f"logit_bias: {V} is not a token id"),
        ({"logit_bias": {3: 1.0, str(V + 7): -1.0}}, f"logit_bias: {V + 7} is not a token id"),
        ({"allowed_token_ids": [4, V]}, f"allowed_token_ids[1]: {V} is not a token id"),
    ],
)
def test_out_of_vocab_ids_are_refused(llm: LLM, params: dict[str, object], message: str) -> None:
    bad = SamplingParams(max_tokens=2, **params)  # type: ignore[arg-type]
    full = re.escape(f"{message} (an integer from 0 to {V - 1})")
    with pytest.raises(ValueError, match=full):
        llm.generate("Once upon a time", bad, use_tqdm=False)
    with pytest.raises(ValueError, match=full):
        llm.engine.add_request("direct", [5, 6, 7], bad)
    assert not llm.engine.has_unfinished_requests()


def test_negative_ids_are_refused_by_the_params() -> None:
    """No vocabulary needed: SamplingParams itself refuses them."""
    with pytest.raises(ValueError, match="logit_bias: -1 is not a token id"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match=re.escape("allowed_token_ids[0]: -2 is not a token")):
        SamplingParams(allowed_token_ids=[-2])


def test_ids_at_the_vocab_edge_run(llm: LLM) -> None:
    edge = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[V - 1])
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, edge, use_tqdm=False)
    assert out.outputs[0].token_ids == [V - 1] * 3
    biased = SamplingParams(temperature=0, max_tokens=2, logit_bias={0: 100.0, V - 1: -100.0})
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, biased, use_tqdm=False)
    assert out.outputs[0].token_ids == [0, 0]
