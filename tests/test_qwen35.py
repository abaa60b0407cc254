"""Qwen3.5 (hybrid: Gated-DeltaNet linear attention + gated full attention) against HF
transformers on tiny random checkpoints of both architectures: the config read, greedy tokens
plain and under chunked prefill + preemption with a KV pool and a state pool too small for the
batch, log-probs to 1e-4, and the state slots' accounting in the scheduler."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_models import ARCHS, build_text_model, make_checkpoints
from scheduler_steps import add, assert_idle, create_requests, run, step
from test_logprobs_oracle import check_request
from test_quantization import _round_inputs, assert_greedy_matches, dequantized_hf

from conftest import TINY, hf_greedy, hf_model, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.layers import quant

MAX_NEW = 16
PROMPTS = random_prompts(8, (1, 60), TINY["vocab_size"], seed=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("qwen35"))


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> Any:
    return hf_model(checkpoints[ARCHS[0]])


@pytest.fixture(scope="module")
def expected(oracle: Any) -> list[list[int]]:
    """HF's greedy tokens for PROMPTS."""
    return hf_greedy(oracle, PROMPTS, MAX_NEW, eos=None)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0
    states = llm.engine.scheduler.kv.states
    assert states is not None and states.num_free == states.num_slots  # every slot back
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_config_reads_both_architectures(arch: str, checkpoints: dict[str, Path]) -> None:
    cfg = ModelConfig.from_model_dir(checkpoints[arch])
    assert cfg.architecture == "Qwen3_5ForCausalLM"  # the vision-language one: its text model
    assert cfg.hybrid is not None
    assert cfg.hybrid.layer_linear == (True, False, True, False)
    assert (cfg.hybrid.key_heads, cfg.hybrid.value_heads) == (2, 4)
    assert (cfg.hybrid.key_dim, cfg.hybrid.value_dim, cfg.hybrid.conv_kernel) == (16, 16, 4)
    assert (cfg.qk_norm, cfg.unit_offset_norm, cfg.head_dim, cfg.rotary_dim) == (
        "head",
        True,
        32,
        8,
    )
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (384, 64, 4)
    # only the two full-attention layers hold KV
    assert cfg.num_kv_layers * cfg.kv_values_per_token() * 4 == 2 * 2 * 2 * 32 * 4


def test_state_pool_sized_from_the_memory_budget(checkpoints: dict[str, Path]) -> None:
    """Unless given, state slots take at most half of kv_cache_memory (here fewer than
    max_num_seqs) and the KV pool gets the rest; the bytes counted are those the runner holds,
    and only the attention layers hold KV caches."""
    budget = 100_000
    llm = LLM(str(checkpoints[ARCHS[0]]), kv_cache_memory=budget, max_num_seqs=8)
    states, cache = llm.engine.runner.states, llm.engine.config.cache
    assert len(states) == 2 and cache.num_state_slots is not None
    per_slot = sum(t.nbytes for s in states for t in (s.conv, s.ssm)) // cache.num_state_slots
    assert cache.num_state_slots == budget // 2 // per_slot < 8
    kv = [c for c in llm.engine.runner.kv_caches if c.numel()]
    assert len(kv) == 2  # layers 1 and 3
    per_block = sum(c.nbytes for c in kv) // cache.num_kv_blocks
    assert cache.num_kv_blocks == (budget - cache.num_state_slots * per_slot) // per_block
    given = LLM(str(checkpoints[ARCHS[0]]), kv_cache_memory=budget, num_state_slots=1)
    assert given.engine.config.cache.num_state_slots == 1
    assert given.engine.config.cache.num_kv_blocks == (budget - per_slot) // per_block


def test_the_hybrid_parts_change_hf_output() -> None:
    """The linear layers and gated attention count in HF's own logits (else parity could not
    fail for them)."""
    ids = torch.tensor([random_prompts(1, (40, 40), TINY["vocab_size"], seed=9)[0]])
    with torch.no_grad():
        on = build_text_model().forward(ids, use_cache=False).logits
        off = build_text_model(layer_types=["full_attention"] * 4).forward(ids, use_cache=False)
    assert (on - off.logits).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity(
    arch: str,
    checkpoints: dict[str, Path],
    expected: list[list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both checkpoints (the same text weights) give HF's greedy tokens; prefix caching is
    switched off for the hybrid model with one log line."""
    assert len({t for row in expected for t in row}) >= 15  # not one repeated token
    with caplog.at_level(logging.INFO, logger="pagedllm.hybrid_config"):
        llm = LLM(str(checkpoints[arch]))
    assert "prefix caching is disabled" in caplog.text
    assert not llm.engine.config.cache.enable_prefix_caching
    assert greedy(llm, PROMPTS) == expected


def test_chunked_prefill_and_preemption_with_few_state_slots(
    checkpoints: dict[str, Path], expected: list[list[int]]
) -> None:
    """Prompts prefilled in 13-token chunks (the state carried across chunks), a pool of 24
    blocks of 4 tokens too small for the batch (preempted requests recompute their state from
    zeros), and 3 state slots for 8 requests (the others wait for one)."""
    llm = LLM(
        str(checkpoints[ARCHS[0]]),
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=13,
        num_state_slots=3,
    )
    assert greedy(llm, PROMPTS) == expected
    states = llm.engine.scheduler.kv.states
    assert states is not None and states.peak_used == 3
    assert llm.engine.stats().num_preemptions > 0


def test_logprobs_within_1e4(checkpoints: dict[str, Path], oracle: Any) -> None:
    """Sample and prompt log-probs (top 5) against the log_softmax of HF's logits, with
    chunked prefill."""
    prompts = random_prompts(4, (5, 40), TINY["vocab_size"], seed=11)
    params = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=2),
    ] * 2
    llm = LLM(str(checkpoints[ARCHS[0]]), block_size=4, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        check_request(oracle, out, p)


@pytest.mark.parametrize("arch", ARCHS)
def test_two_tensor_parallel_ranks(
    arch: str, checkpoints: dict[str, Path], expected: list[list[int]]
) -> None:
    """Two ranks, each with half of the attention heads and of the linear layers' key and
    value heads (and its half of every request's state): HF's greedy tokens, with chunked
    prefill and few state slots."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    with LLM(
        str(checkpoints[arch]),
        device="cpu",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        block_size=4,
        num_state_slots=3,
    ) as llm:
        # rank 0's state pools: 2 of the 4 value heads, 3 slots
        assert [tuple(s.ssm.shape) for s in llm.engine.runner.states] == [(3, 2, 16, 16)] * 2
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_weight_quantization(method: str, checkpoints: dict[str, Path]) -> None:
    """Weights quantized at load, the linear layers' in/out projections too: HF's greedy
    tokens on the same dequantized weights (inputs rounded as the kernels round them)."""
    path = checkpoints[ARCHS[0]]
    model = dequantized_hf(path, method)
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names]
    assert len(linears) == 2 * len(names)
    with torch.no_grad():
        for module in linears:
            module.weight.copy_(quant.quantize(module.weight, method).dequantize())
    _round_inputs(linears)
    prompts = random_prompts(6, (3, 40), TINY["vocab_size"], seed=12)
    expected = hf_greedy(model, prompts, 10, eos=None)
    llm = LLM(str(path), quantization=method, max_num_batched_tokens=16, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_matches(model, prompts, [o.outputs[0].token_ids for o in outs], expected)


# --- the state slots in the scheduler (no model) ----------------------------------------------


def _scheduler(num_state_slots: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(4, 64, enable_prefix_caching=False, num_state_slots=num_state_slots),
    )


def test_requests_wait_for_a_state_slot() -> None:
    """Two slots, three requests: the third is admitted only once one finishes, into the
    freed slot; an abort frees its slot at once."""
    sched = _scheduler(2)
    requests = create_requests(3, prompt_len=8, max_tokens=3)
    add(sched, requests)
    out, _ = step(sched)
    assert [(s.request_id, s.state_slot) for s in out.scheduled] == [("r0", 0), ("r1", 1)]
    assert [r.request_id for r in sched.waiting] == ["r2"]
    sched.abort("r0")
    out, _ = step(sched)
    assert {s.request_id: s.state_slot for s in out.scheduled} == {"r1": 1, "r2": 0}
    sched.check_integrity()
    run(sched)
    assert_idle(sched)
    assert sched.kv.states is not None and sched.kv.states.num_free == 2


def test_preemption_frees_the_state_slot() -> None:
    """A preempted request gives its slot back; readmitted, it starts over at position 0
    (so the runner starts its state from zeros)."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(4, 6, enable_prefix_caching=False, num_state_slots=2),
    )
    add(sched, create_requests(2, prompt_len=8, max_tokens=8, ignore_eos=True))
    starts: dict[str, list[int]] = {}
    preempted = False
    while sched.has_unfinished():
        out, _ = step(sched)
        preempted |= bool(out.preempted_ids)
        for rid in out.preempted_ids:
            assert sched.kv.states is not None and rid not in sched.kv.states.holders()
        for s in out.scheduled:
            starts.setdefault(s.request_id, []).append(s.start_pos)
    assert preempted and starts["r1"].count(0) == 2, starts
    assert_idle(sched)


def test_beam_search_is_refused(checkpoints: dict[str, Path]) -> None:
    """A beam would need a copy of its parent's recurrent state: refused with a clear error."""
    from pagedllm.beam_search import BeamSearchParams
    from pagedllm.core.beam_group import BeamGroup

    model = ModelConfig.from_model_dir(checkpoints[ARCHS[0]])
    group = BeamGroup.create(
        "g", [3, 4, 5], BeamSearchParams(beam_width=2, max_tokens=4), model, 20
    )
    with pytest.raises(ValueError, match="hybrid"):
        _scheduler(2).add_beam_group(group)


def test_pooling_lora_and_speculation_are_refused(checkpoints: dict[str, Path]) -> None:
    """Neither the pooling runner (no state slots), LoRA (the fused q projection carries the
    attention gates) nor speculation runs a hybrid model: each refused at start, naming it."""
    from pagedllm.errors import ConfigError

    with pytest.raises(ConfigError, match="hybrid"):
        LLM(checkpoints[ARCHS[0]], runner="pooling")
    with pytest.raises(ConfigError, match="hybrid"):
        LLM(checkpoints[ARCHS[0]], enable_lora=True)
    with pytest.raises(ConfigError, match="hybrid"):  # a rejected draft's state cannot roll back
        LLM(checkpoints[ARCHS[0]], speculative_config={"method": "ngram"})
