"""Speculative decoding (n-gram prompt lookup): greedy output identical token for token to no
speculation on every scheduler path and sampling feature, seeded sampling reproduced exactly,
unseeded sampling distributed as without speculation, and the KV pool and prefix cache
consistent after the rejected tails are rolled back."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError
from pagedllm.core.spec_decode import _Acceptance, ngram_propose
from pagedllm.outputs import RequestOutput
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.text import Tokenizer

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "max_batch_size": 1024,
}
VOCAB = TINY["vocab_size"]


def test_ngram_propose_takes_the_latest_longest_match() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 3, 4, 6, 7]
    # suffix [6, 7] occurs at 1 and 6: the latest (6) is followed by 3, 4, 6, 7
    assert ngram_propose(tokens, 3, 1, 2) == [3, 4, 6]
    # with n up to 3 the suffix [4, 6, 7] never occurred before: n = 2 is used
    assert ngram_propose(tokens, 3, 2, 3) == [3, 4, 6]
    # the proposal stops where the sequence does
    assert ngram_propose([1, 2, 3, 1, 2], 5, 1, 2) == [3, 1, 2]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []  # 4 never occurred before
    assert ngram_propose([1, 2, 3, 9, 2, 3], 3, 3, 3) == []  # n_min 3: [9, 2, 3] is new
    assert ngram_propose([7], 3, 1, 3) == []


def test_backoff_pauses_grow_while_drafts_fail() -> None:
    """Low acceptance pauses a request's drafts, twice as long each time in a row (capped),
    until a draft is accepted again."""
    state = _Acceptance()
    pauses, drafts = [], 0
    while len(pauses) < 6:
        state.update(0.0, 0.2)
        drafts += 1
        if state.skip:
            pauses.append(state.skip)
            state.skip = 0
    assert pauses == [8, 16, 32, 64, 64, 64]
    assert drafts == 3 + 5  # the average falls from 1 below 0.2 in 3, then 1 try a pause
    state.update(0.5, 0.2)  # accepted: no pause, and the next one is short again
    state.update(0.0, 0.2)
    assert state.skip == 8


def test_speculative_config_from_vllm_dict() -> None:
    cfg = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": "3"}')
    assert cfg is not None and cfg.num_speculative_tokens == 3
    one = SpeculativeConfig.from_dict({"prompt_lookup_max": 1})
    assert one is not None and (one.prompt_lookup_min, one.prompt_lookup_max) == (1, 1)
    assert SpeculativeConfig.from_dict({}) is None and SpeculativeConfig.from_dict(None) is None
    with pytest.raises(ConfigError, match="unknown speculative_config keys: nope"):
        SpeculativeConfig.from_dict({"nope": 1})
    with pytest.raises(ConfigError, match="not supported"):
        SpeculativeConfig.from_dict({"method": "eagle"})
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        SpeculativeConfig.from_dict({"prompt_lookup_min": 4, "prompt_lookup_max": 2})


def copy_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: a random model's greedy output tends to fall into
    cycles, and both make n-gram drafts that are accepted."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 8))]
        out.append(phrase * rng.randint(2, 5) + [rng.randrange(2, VOCAB)])
    return out


PROMPTS = copy_prompts(8, seed=1) + random_prompts(4, (5, 40), VOCAB, seed=2)


def generate(
    path: Path, prompts: list[Any], params: Any, spec: dict[str, Any] | None, **kw: Any
) -> tuple[list[RequestOutput], LLM]:
    llm = LLM(str(path), dtype="float32", speculative_config=spec, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.scheduler.kv.pool.num_used_blocks == 0
    return outs, llm


def assert_same(a: list[RequestOutput], b: list[RequestOutput], logprobs: bool = False) -> None:
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            assert cx.text == cy.text
            assert (cx.finish_reason, cx.stop_reason) == (cy.finish_reason, cy.stop_reason)
            if logprobs:
                assert cx.logprobs is not None and cy.logprobs is not None
                assert len(cx.logprobs) == len(cy.logprobs) == len(cx.token_ids)
                for lx, ly in zip(cx.logprobs, cy.logprobs, strict=True):
                    assert lx.keys() == ly.keys()
                    for t in lx:
                        assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-4)
                        assert lx[t].rank == ly[t].rank


def accepted(llm: LLM) -> int:
    spec = llm.engine.scheduler.spec
    assert spec is not None
    return spec.num_accepted_tokens


ENGINES: dict[str, dict[str, Any]] = {
    "default": {},
    # prompts cut in chunks; blocks of 4 tokens: drafts cross block boundaries
    "chunked": {"max_num_batched_tokens": 16, "block_size": 4},
    # a pool so small that requests are preempted and recomputed
    "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 64},
    "no_prefix_cache": {"enable_prefix_caching": False},
    # other families: q/k/v bias and tied embeddings; a sliding window of 24 (blocks that fall
    # out of it freed as requests go)
    "qwen2": {"arch": "qwen2"},
    "mistral": {"arch": "mistral", "block_size": 4},
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_identical_on_scheduler_paths(checkpoints: dict[str, Path], engine: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    kw = dict(ENGINES[engine])
    path = checkpoints[kw.pop("arch", "llama")]
    # the prompts twice: the second time they hit the prefix cache
    prompts: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS + PROMPTS]
    base, _ = generate(path, prompts, params, None, **kw)
    spec, llm = generate(path, prompts, params, NGRAM, **kw)
    assert_same(base, spec, logprobs=True)
    assert accepted(llm) > 50  # speculation happened, and was mostly right
    if engine == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


def test_greedy_identical_with_stops_and_sampling_features(checkpoints: dict[str, Path]) -> None:
    """Every way a request ends or is steered, inside runs of accepted drafts, in one batch
    with structured outputs (drafting under their grammar) and with n > 1."""
    path = checkpoints["llama"]
    prompts = PROMPTS[:8]
    base_out, _ = generate(
        path,
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        None,
    )
    tok = Tokenizer.from_model_dir(path)
    cases: list[SamplingParams] = []
    for i, out in enumerate(base_out):
        ids = out.outputs[0].token_ids
        text = tok.decode(ids[10:14])
        cases += [
            # EOS / a stop token id landing inside an accepted run
            SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[12 + i % 5]]),
            # max_tokens inside an accepted run
            SamplingParams(temperature=0, max_tokens=7 + i, ignore_eos=True),
            # a stop string: the tokens after it are not emitted
            SamplingParams(temperature=0, max_tokens=30, stop=[text[1:4]], ignore_eos=True),
            SamplingParams(
                temperature=0, max_tokens=30, stop=[text[1:4]], include_stop_str_in_output=True
            ),
            # min_tokens holding back a stop token the drafts propose
            SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=[ids[12]]),
            SamplingParams(temperature=0, max_tokens=30, bad_words_ids=[[ids[14], ids[15]]]),
            SamplingParams(temperature=0, max_tokens=30, logit_bias={ids[20]: 5.0}),
            SamplingParams(
                temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.2
            ),
            SamplingParams(temperature=0, max_tokens=20, n=2, logprobs=1),
            # seeded sampling: the same tokens with and without speculation
            SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=25, n=2),
            SamplingParams(
                temperature=0, max_tokens=12, structured_outputs={"regex": "[a-z]{3,8} [0-9]{2}"}
            ),
        ]
    all_prompts: list[Any] = [{"prompt_token_ids": p} for p in prompts for _ in range(11)]
    base, _ = generate(path, all_prompts, cases, None)
    spec, llm = generate(path, all_prompts, cases, NGRAM)
    assert_same(base, spec)
    assert accepted(llm) > 100
    stopped = [o.outputs[0] for o in spec if o.outputs[0].stop_reason is not None]
    assert any(isinstance(c.stop_reason, str) for c in stopped)
    assert any(isinstance(c.stop_reason, int) for c in stopped)


WORDS = ["cat", "dog", "mat"]
STRUCTURED: list[dict[str, Any]] = [
    {"regex": "(cat|dog|mat)( (cat|dog|mat)){15}"},
    {"json": {"type": "array", "items": {"enum": WORDS}, "minItems": 12, "maxItems": 12}},
    {
        "json": {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 40}},
            "required": ["a"],
        }
    },
]


def test_structured_outputs_draft_and_stay_identical(checkpoints: dict[str, Path]) -> None:
    """Regex and JSON-schema requests whose prompts (and answers) repeat a phrase: drafted,
    verified under the grammar's mask at every position, and the greedy output is the same as
    without speculation (each still valid under its grammar)."""
    path = checkpoints["llama"]
    rng = random.Random(3)
    prompts: list[Any] = []
    cases: list[SamplingParams] = []
    for i in range(6):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))
        prompts.append(f"{words} {words} {words} {words}")
        cases.append(
            SamplingParams(
                temperature=0, max_tokens=40, structured_outputs=STRUCTURED[i % len(STRUCTURED)]
            )
        )
    base, _ = generate(path, prompts, cases, None)
    spec, llm = generate(path, prompts, cases, NGRAM)
    assert_same(base, spec)
    assert accepted(llm) > 10  # the constrained requests drafted, and drafts were kept


def test_sampling_matches_the_target_distribution(checkpoints: dict[str, Path]) -> None:
    """Unseeded sampling: the tokens' distribution at each output position with speculation
    is as close to runs without as two runs without are to each other (total variation).
    The prompt ends in the cycle the model falls into under greedy decoding; at a low
    temperature the samples follow it often (the drafts are mostly accepted) but not always
    (several tokens per position)."""
    path = checkpoints["llama"]
    start = copy_prompts(1, seed=5)[0]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    cycle, _ = generate(path, [{"prompt_token_ids": start}], greedy, None)
    prompt = {"prompt_token_ids": start + cycle[0].outputs[0].token_ids}
    n, length = 300, 6
    params = SamplingParams(temperature=0.02, max_tokens=length, ignore_eos=True)

    def positions(spec: dict[str, Any] | None) -> tuple[list[Counter[int]], LLM]:
        outs, llm = generate(path, [prompt] * n, params, spec, max_num_seqs=128)
        counts = [Counter(o.outputs[0].token_ids[i] for o in outs) for i in range(length)]
        return counts, llm

    def tv(a: Counter[int], b: Counter[int]) -> float:
        return sum(abs(a[t] - b[t]) for t in a.keys() | b.keys()) / (2 * n)

    base1, _ = positions(None)
    base2, _ = positions(None)
    spec, llm = positions(NGRAM)
    assert accepted(llm) > n  # drafts were accepted, so they shaped the samples
    assert all(len(c) >= 5 for c in base1[1:])  # random positions, not near-greedy
    controls = [tv(base1[i], base2[i]) for i in range(length)]
    gaps = [(tv(base1[i], spec[i]) + tv(base2[i], spec[i])) / 2 for i in range(length)]
    # averaged over the positions: one position's distance is noisy at n = 300 (a sampler
    # that took every draft would sit near the greedy cycle, a gap of ~0.3 and more)
    assert sum(gaps) / length < sum(controls) / length + 0.05, (gaps, controls)


def test_tensor_parallel_greedy_identical(checkpoints: dict[str, Path]) -> None:
    """Two ranks speculating (the step's plan, the drafts' decode rows included, broadcast to
    the worker): the greedy tokens of one rank without speculation."""
    path = checkpoints["llama"]
    prompts: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    base, _ = generate(path, prompts, params, None)
    spec, llm = generate(path, prompts, params, NGRAM, device="cpu", tensor_parallel_size=2)
    try:
        assert_same(base, spec, logprobs=True)
        assert accepted(llm) > 30
    finally:
        llm.close()


def test_metrics_settings_and_cli(checkpoints: dict[str, Path]) -> None:
    """vLLM's spec_decode counters, exported under its names; the llm_engine model's
    `speculative_config` parameter and `pagedllm serve --speculative-config`."""
    import argparse
    import json

    from pagedllm.cli import _speculative
    from pagedllm.serving.metrics import COUNTERS, MetricsExporter
    from pagedllm.serving.settings import engine_config

    path = checkpoints["llama"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, llm = generate(path, [{"prompt_token_ids": p} for p in PROMPTS[:6]], params, NGRAM)
    stats = llm.engine.stats()
    # every emitted token counted once, several per step
    assert stats.generation_tokens == sum(len(o.outputs[0].token_ids) for o in outs)
    assert stats.spec_decode is not None
    drafts, drafted, accepted, per_pos = stats.spec_decode
    assert 0 < accepted <= drafted <= 4 * drafts and sum(per_pos) == accepted
    assert list(per_pos) == sorted(per_pos, reverse=True)  # a position needs the ones before
    updates = list(MetricsExporter().updates(stats, []))
    counters = {(u.name, u.labels): u.value for u in updates if u.kind == "counter"}
    assert counters[("vllm:spec_decode_num_drafts_total", ())] == drafts
    assert counters[("vllm:spec_decode_num_draft_tokens_total", ())] == drafted
    assert counters[("vllm:spec_decode_num_accepted_tokens_total", ())] == accepted
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [counters.get((name, (("position", str(i)),)), 0) for i in range(4)] == list(per_pos)
    assert {n for n, _ in counters} <= set(COUNTERS)

    text = json.dumps(NGRAM)
    config = engine_config({"model_dir": str(path), "speculative_config": text}, "cpu")
    assert config.speculative == SpeculativeConfig.from_dict(NGRAM)
    assert (
        engine_config({"model_dir": str(path), "speculative_config": "{}"}, "cpu").speculative
        is None
    )
    assert _speculative(text) == text
    with pytest.raises(argparse.ArgumentTypeError, match="num_speculative_tokens"):
        _speculative('{"num_speculative_tokens": 0}')


def test_rollback_keeps_the_pool_and_prefix_cache_consistent(checkpoints: dict[str, Path]) -> None:
    """Step by step with blocks of 4 tokens (drafts cross them, rejected tails free them):
    the pool's integrity holds after every step, every hash in the prefix cache is one of a
    request's real token blocks (none covers a rejected draft), and requests that hit those
    blocks later generate what an engine without a cache does."""
    path = checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", block_size=4, speculative_config=NGRAM)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = []
    for i, p in enumerate(PROMPTS[:8]):
        engine.add_request(str(i), p, params)
        requests.append(engine.scheduler.requests[str(i)])
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
        real = {h for r in requests for h in r.block_hashes}
        assert set(engine.scheduler.kv.pool._cached) <= real
    assert accepted(llm) > 30
    again: list[Any] = [
        {"prompt_token_ids": p + outputs[str(i)][:20]} for i, p in enumerate(PROMPTS[:8])
    ]
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hits = llm.generate(again, short, use_tqdm=False)
    assert engine.scheduler.kv.prefix_hits > 0
    plain, _ = generate(path, again, short, None, enable_prefix_caching=False)
    assert_same(hits, plain)


@pytest.mark.slow
def test_smollm2_copy_tasks_identical_with_drafts_accepted() -> None:
    """The real model (fp32) on prompts whose answer copies them: the same greedy text as
    without speculation, with drafts verified and accepted."""
    from pagedllm.prepare import prepare_smollm2

    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    asks = [
        f"Rename the function `add` to `plus` in this code:\n\n{code}",
        "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the "
        "river bank, then runs back home.",
    ]
    prompts: list[Any] = [f"<|im_start|>user\n{a}<|im_end|>\n<|im_start|>assistant\n" for a in asks]
    params = SamplingParams(temperature=0, max_tokens=40)
    path = prepare_smollm2()
    base, _ = generate(path, prompts, params, None, max_model_len=512)
    spec, llm = generate(path, prompts, params, NGRAM, max_model_len=512)
    assert_same(base, spec)
    stats = llm.engine.stats().spec_decode
    assert stats is not None and stats[0] >= 3 and stats[2] > 0  # drafts, some accepted
