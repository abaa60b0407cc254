"""Speculative decoding with a draft model: greedy output identical token for token to no
speculation on every scheduler path (with a random draft of the target's vocabulary, and with
the target as its own draft, whose drafts are all accepted only if its KV is kept right), the
rejection rule's samples distributed as the target's, seeded requests reproducible, the KV
pool, prefix cache and the draft's KV bookkeeping consistent, and a draft of another
vocabulary refused."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_spec_decode import ENGINES, PROMPTS, assert_same, copy_prompts, generate

from conftest import make_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, EngineConfig
from pagedllm.spec_config import SpeculativeConfig


def spec(draft: Path, k: int = 4) -> dict[str, Any]:
    return {"model": str(draft), "num_speculative_tokens": k, "max_batch_size": 1024}


@pytest.fixture(scope="module")
def drafts(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """`random`: a one-layer llama of other random weights; `noisy`: the llama target with
    noise on its weights (close to it, not equal: drafts accepted and rejected)."""
    root = tmp_path_factory.mktemp("drafts")
    random_draft = make_checkpoint(root / "random", "llama", seed=7, num_hidden_layers=1)
    noisy = root / "noisy"
    shutil.copytree(checkpoints["llama"], noisy)
    weights = load_file(noisy / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name, w in weights.items():
        if w.dim() == 2:
            weights[name] = w + 0.5 * w.std() * torch.randn(w.shape, generator=gen)
    save_file(weights, noisy / "model.safetensors", metadata={"format": "pt"})
    return {"random": random_draft, "noisy": noisy}


def counters(llm: LLM) -> tuple[int, int]:
    """(draft tokens, accepted tokens)."""
    stats = llm.engine.stats().spec_decode
    assert stats is not None
    return stats[1], stats[2]


def test_config_and_refusals(
    checkpoints: dict[str, Path], drafts: dict[str, Path], tmp_path: Path
) -> None:
    cfg = SpeculativeConfig.from_dict({"model": "/x", "num_speculative_tokens": 3})
    assert cfg is not None and cfg.method == "draft_model"
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "/x"}) == cfg.__class__(
        method="draft_model", model="/x"
    )
    with pytest.raises(ConfigError, match="draft_model"):
        SpeculativeConfig.from_dict({"method": "draft_model"})
    with pytest.raises(ConfigError, match="draft_model"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "/x"})
    target = checkpoints["llama"]
    # another vocabulary size, then the same size with two token ids swapped
    other = make_checkpoint(tmp_path / "other", "llama", vocab_size=400)
    with pytest.raises(ConfigError, match="vocabulary of 400 tokens, the target 384"):
        EngineConfig.create(target, speculative_config={"model": str(other)})
    swapped = tmp_path / "swapped"
    shutil.copytree(drafts["random"], swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=r"tokenizer .* is not the target.s"):
        EngineConfig.create(target, speculative_config={"model": str(swapped)})
    # the draft's KV shares the blocks: the same budget holds fewer (target 2 layers, draft 1)
    draft = {"model": str(drafts["random"])}
    alone = EngineConfig.create(target, kv_cache_memory=1 << 22, max_num_seqs=1024)
    both = EngineConfig.create(
        target, kv_cache_memory=1 << 22, max_num_seqs=1024, speculative_config=draft
    )
    blocks = alone.cache.num_kv_blocks, both.cache.num_kv_blocks
    assert blocks[0] is not None and blocks[1] == blocks[0] * 2 // 3
    # a windowed target keeps its blocks: the draft reads them through its own layers
    mistral = EngineConfig.create(
        checkpoints["mistral"], speculative_config={"model": str(checkpoints["mistral"])}
    )
    assert mistral.cache.sliding_window is None


# chunked: prompts in chunks, blocks of 4 (drafts cross them), prefix hits (the prompts twice)
@pytest.mark.parametrize("engine", ["chunked", "preempt", "mistral"])
def test_greedy_identical_with_the_target_as_draft(
    checkpoints: dict[str, Path], engine: str
) -> None:
    """The target drafting for itself proposes what it will verify: nearly every draft is
    accepted, which holds only if its KV is right after rollbacks, chunks, prefix hits and
    preemptions (a wrong draft KV costs acceptance, never output)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    kw = dict(ENGINES[engine])
    path = checkpoints[kw.pop("arch", "llama")]
    prompts: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS + PROMPTS]
    base, _ = generate(path, prompts, params, None, **kw)
    out, llm = generate(path, prompts, params, spec(path), **kw)
    assert_same(base, out, logprobs=True)
    drafted, accepted = counters(llm)
    assert drafted > 500 and accepted > 0.97 * drafted
    if engine == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


def test_greedy_identical_with_another_draft(
    checkpoints: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """A draft that differs from the target: rejections, preemptions, prefix hits."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(ENGINES["preempt"])
    path = checkpoints["llama"]
    prompts: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS + PROMPTS]
    base, _ = generate(path, prompts, params, None, **kw)
    out, llm = generate(path, prompts, params, spec(drafts["noisy"]), **kw)
    assert_same(base, out)
    drafted, accepted = counters(llm)
    assert 0 < accepted < drafted  # drafts kept and drafts rejected
    assert llm.engine.scheduler.num_preemptions > 0


def test_greedy_stops_and_sampling_features(
    checkpoints: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """Stops, penalties, logit bias, bad words, n > 1 and structured outputs inside runs of
    accepted drafts, in one batch (the n-gram test's cases)."""
    path = checkpoints["llama"]
    cases = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[PROMPTS[0][2]]),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=[5]),
        SamplingParams(temperature=0, max_tokens=30, bad_words_ids=[[7, 8]], logit_bias={9: 3.0}),
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=20, n=2, logprobs=1),
        SamplingParams(
            temperature=0, max_tokens=12, structured_outputs={"regex": "[a-z]{3,8} [0-9]{2}"}
        ),
    ]
    prompts: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS[:6] for _ in cases]
    params = cases * 6
    base, _ = generate(path, prompts, params, None)
    for draft in (path, drafts["noisy"]):
        out, llm = generate(path, prompts, params, spec(draft))
        assert_same(base, out)
        assert counters(llm)[1] > 50


def distribution_runs(
    path: Path, draft: Path, n: int = 300, length: int = 6
) -> tuple[list[list[Counter[int]]], LLM]:
    """Per-position token counts of n unseeded samples: twice without speculation, once with."""
    prompt = {"prompt_token_ids": copy_prompts(1, seed=5)[0]}
    params = SamplingParams(temperature=0.8, max_tokens=length, ignore_eos=True)
    runs = []
    for cfg in (None, None, spec(draft)):
        outs, llm = generate(path, [prompt] * n, params, cfg, max_num_seqs=128)
        runs.append([Counter(o.outputs[0].token_ids[i] for o in outs) for i in range(length)])
    return runs, llm


def test_sampling_matches_the_target_distribution(
    checkpoints: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """The rejection rule with a draft close to the target but not equal (drafts accepted and
    rejected, the residual max(0, p - q) drawn from): per-position token distributions as close
    to runs without speculation as two runs without are to each other (total variation)."""
    n, length = 300, 6
    (base1, base2, spec_run), llm = distribution_runs(
        checkpoints["llama"], drafts["noisy"], n, length
    )
    drafted, accepted = counters(llm)
    assert 0.2 * drafted < accepted < 0.9 * drafted  # both branches of the rule, often
    assert all(len(c) >= 5 for c in base1[1:])  # spread-out distributions

    def tv(a: Counter[int], b: Counter[int]) -> float:
        return sum(abs(a[t] - b[t]) for t in a.keys() | b.keys()) / (2 * n)

    controls = [tv(base1[i], base2[i]) for i in range(length)]
    gaps = [(tv(base1[i], spec_run[i]) + tv(base2[i], spec_run[i])) / 2 for i in range(length)]
    assert sum(gaps) / length < sum(controls) / length + 0.05, (gaps, controls)


def test_seeded_requests_reproducible(
    checkpoints: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """A seeded request's drafts and verification draw from its own per-step streams: the same
    tokens in another run, alone or among other requests."""
    path = checkpoints["llama"]
    prompts: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS[:6]]
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=24, ignore_eos=True)
        for i in range(6)
    ]
    cfg = spec(drafts["noisy"])
    first, _ = generate(path, prompts, seeded, cfg)
    second, _ = generate(path, prompts, seeded, cfg)
    assert_same(first, second)
    others: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS[6:]]
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    mixed, llm = generate(path, others + prompts, [unseeded] * len(others) + seeded, cfg)
    assert_same(first, mixed[len(others) :])
    assert counters(llm)[1] > 0


def test_rollback_keeps_the_pool_and_draft_kv_consistent(
    checkpoints: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """Step by step with blocks of 4 tokens: the pool's integrity, prefix-cache hashes of real
    token blocks only, and no request's draft KV counted past its computed tokens; an abort
    frees its blocks and the draft forgets it."""
    path = checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", block_size=4, speculative_config=spec(drafts["noisy"]))
    engine = llm.engine
    drafter = engine.runner.drafter
    assert drafter is not None
    params = SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True)
    requests = []
    for i, p in enumerate(PROMPTS[:8]):
        engine.add_request(str(i), p, params)
        requests.append(engine.scheduler.requests[str(i)])
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 3:
            engine.abort_request("0")
        engine.check_integrity()
        real = {h for r in requests for h in r.block_hashes}
        assert set(engine.scheduler.kv.pool._cached) <= real
        for r in engine.scheduler.running:
            assert drafter.computed.get(r.request_id, 0) <= r.num_computed_tokens
    assert engine.scheduler.kv.pool.num_used_blocks == 0
    assert counters(llm)[1] > 20
    engine.add_request("next", PROMPTS[8], params)
    engine.step()  # the finished requests' ids reach the runner with the next step
    assert set(drafter.computed) == {"next"}


def test_served_settings_take_the_draft_form(checkpoints: dict[str, Path]) -> None:
    """`pagedllm serve --speculative-config` and the llm_engine parameter take the draft form."""
    from pagedllm.cli import _speculative
    from pagedllm.serving.settings import engine_config

    path = checkpoints["llama"]
    text = json.dumps({"model": str(path), "num_speculative_tokens": 3})
    assert _speculative(text) == text
    config = engine_config({"model_dir": str(path), "speculative_config": text}, "cpu")
    assert config.speculative is not None and config.speculative.method == "draft_model"
    assert config.speculative.model == str(path)


def test_rejection_rule_emits_the_target_distribution() -> None:
    """The rule against its oracle, p itself: over many draws (the drafts drawn from q), the
    first emitted token is distributed as p_0 and, after an accepted first draft, the second
    as p_1 — with q far enough from p that drawing a rejection's token from p instead of
    max(0, p - q) would be off by 0.1 in total variation."""
    from pagedllm.worker.rejection import draw, rejection_sample

    p = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2] * 5])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.4], [0.4, 0.3, 0.1, 0.1, 0.1]])
    torch.manual_seed(0)
    n = 40_000
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True) for i in range(2)], 1)
    first, second = torch.zeros(5), torch.zeros(5)
    for d in drafts.tolist():
        tokens = rejection_sample(p, q, d, None)
        first[tokens[0]] += 1
        if len(tokens) > 1:  # d_1 was accepted: the next token follows p_1
            second[tokens[1]] += 1
    assert (first / n - p[0]).abs().sum() / 2 < 0.015
    assert (second / second.sum() - p[1]).abs().sum() / 2 < 0.025
    assert draw(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0.99])) == [1]
