"""The decoder layers of a decode step in one C++ call (csrc/decoder.cpp) against the same
model run op by op from Python: the same kernels in the same order, so the same bits — tokens
and log-probs — for every architecture (q/k/v bias, GQA, sliding window) and weight format.
The op-by-op path is itself held to HF transformers by test_parity and test_quantization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.layers import quant
from pagedllm.layers.attention import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernel_available(), reason="the CPU extension does not build here"
)

FORMATS = {  # name -> LLM keyword arguments
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
}


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        result.append(
            (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        )
    return result


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_one_call_equals_op_by_op(
    arch: str, fmt: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the kernels for every row count, whatever this CPU's limits: several decodes in one call
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS))
    llm = LLM(
        str(checkpoints[arch]),
        max_num_seqs=4,
        max_model_len=128,
        enable_prefix_caching=False,  # the second run computes what the first did
        **FORMATS[fmt],
    )
    model = llm.engine.runner.model
    assert model._kernel_weights, "the one-call path is not set up"
    module = cpu_kernels.kernel_module()
    calls: list[int] = []
    real = module.decode_layers

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(module, "decode_layers", counted)
    # mixed lengths: decodes of 1-4 requests, some past mistral's window of 24
    prompts = random_prompts(4, (3, 40), model.config.vocab_size, seed=list(FORMATS).index(fmt))
    fused = _generate(llm, prompts)
    assert calls and max(calls) > 1, "no step of several decodes went through decode_layers"
    model._kernel_weights = []
    calls.clear()
    op_by_op = _generate(llm, prompts)
    assert not calls
    assert fused == op_by_op


def test_steps_with_a_prefill_run_op_by_op(checkpoints: dict[str, Path]) -> None:
    """A step that holds a prefill chunk is not all decodes: the backend says so."""
    llm = LLM(str(checkpoints["llama"]), max_num_seqs=2, max_model_len=128)
    runner = llm.engine.runner
    seen: list[bool] = []
    real = runner.backend.decode_batch

    def spy(metadata: Any) -> Any:
        out = real(metadata)
        seen.append(out is not None)
        return out

    runner.backend.decode_batch = spy  # type: ignore[method-assign]
    _generate(llm, [[5, 6, 7]])
    assert seen[0] is False and all(seen[1:]) and len(seen) == 20
