"""Greedy parity on the real default model, SmolLM2-135M-Instruct (fp32), against HF
transformers on the same prepared checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.prepare import prepare_smollm2

pytestmark = pytest.mark.slow

PROMPTS = [
    "Once upon a time,",
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return prepare_smollm2()


def test_greedy_parity_with_transformers(smollm2: Path) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    llm = LLM(str(smollm2), dtype="float32", block_size=16, max_num_batched_tokens=24)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
        assert out.outputs[0].token_ids == ref.tolist()
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    assert outs[0].outputs[0].text.startswith(" the city of Nova Haven was a thriving metropolis")
    # the chat prompt ends on <|im_end|> (EOS) before max_tokens
    assert outs[3].outputs[0].finish_reason == "stop"
    assert outs[3].outputs[0].token_ids[-1] == 2
    llm.engine.check_integrity()
