"""Engine-level generation semantics on a tiny model: n > 1 sharing prompt blocks, aborts,
output kinds."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.sampling_params import RequestOutputKind


@pytest.fixture
def engine(checkpoints: dict[str, Path]) -> LLMEngine:
    return LLM(str(checkpoints["llama"]), block_size=16).engine


def test_n_samples_share_prompt_blocks(engine: LLMEngine) -> None:
    prompt = random_prompts(1, (40, 40), TINY["vocab_size"], seed=21)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    engine.add_request("r", prompt, params)
    engine.step()  # all four samples admitted in one step
    pool = engine.scheduler.kv.pool
    tables = [engine.scheduler.kv.block_ids(f"r#{i}") for i in range(4)]
    # the two full prompt blocks are the same physical blocks, held four times
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert [pool.blocks[b].ref_cnt for b in shared] == [4, 4]
    # the partial third block (tokens 32..39 + output) is each sample's own
    assert len({t[2] for t in tables}) == 4
    assert pool.num_used_blocks == 2 + 4
    engine.check_integrity()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # independent samples
    engine.check_integrity()
    assert pool.num_used_blocks == 0


def test_abort_frees_blocks_and_reports_abort(engine: LLMEngine) -> None:
    prompts = random_prompts(3, (20, 40), TINY["vocab_size"], seed=22)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50, n=1 + i % 2))
    for _ in range(3):
        engine.step()
    out = engine.abort_request("r1")
    assert out is not None and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert engine.abort_request("r1") is None  # already gone
    assert engine.abort_request("nope") is None
    engine.check_integrity()
    used = engine.scheduler.kv.pool.num_used_blocks
    assert used == len(engine.scheduler.kv.block_ids("r0")) + len(
        engine.scheduler.kv.block_ids("r2")
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv.pool.num_used_blocks == 0


def test_duplicate_request_id_is_rejected(engine: LLMEngine) -> None:
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="logprobs must be at most 20"):
        engine.add_request("y", [5, 6, 7], SamplingParams(max_tokens=2, logprobs=21))
    assert not engine.output_processor.has("y")


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(engine: LLMEngine, kind: RequestOutputKind) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=kind)
    engine.add_request("k", "Once upon a time", params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    ids = [t for o in outs for t in o.outputs[0].token_ids]
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1 and len(ids) == 6
    elif kind == RequestOutputKind.DELTA:
        assert len(outs) == 6 and len(ids) == 6
    else:
        assert len(outs) == 6 and outs[-1].outputs[0].token_ids == ids[-6:]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_detokenize_false_gives_the_same_ids_and_no_text(
    engine: LLMEngine, kind: RequestOutputKind
) -> None:
    def run(detokenize: bool) -> tuple[list[int], str, list]:
        params = SamplingParams(
            temperature=0,
            max_tokens=6,
            ignore_eos=True,
            logprobs=1,
            output_kind=kind,
            detokenize=detokenize,
        )
        engine.add_request(f"d{detokenize}", "Once upon a time", params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        logprobs = [lp for o in outs for lp in o.outputs[0].logprobs or []]
        return ids, "".join(o.outputs[0].text for o in outs), logprobs

    ids, text, logprobs = run(True)
    ids_raw, text_raw, logprobs_raw = run(False)
    assert ids_raw == ids and text and text_raw == ""
    assert [{t: lp.logprob for t, lp in d.items()} for d in logprobs_raw] == [
        {t: lp.logprob for t, lp in d.items()} for d in logprobs
    ]
    assert all(lp.decoded_token is None for d in logprobs_raw for lp in d.values())
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def _deltas(engine: LLMEngine, params: SamplingParams) -> list:
    engine.add_request("s", "Once upon a time", params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("interval", [2, 3, 16])
def test_stream_interval_sends_fewer_larger_deltas(
    checkpoints: dict[str, Path], interval: int
) -> None:
    """EngineConfig.stream_interval: a DELTA output per `interval` new tokens of a sample,
    its first token at once and its end flushed; together the outputs carry exactly what the
    token-by-token outputs do (ids, text, log-probs), for each of n samples."""
    base = dict(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, logprobs=2)
    params = SamplingParams(**base, n=2, output_kind=RequestOutputKind.DELTA)
    each = LLMEngine(EngineConfig.create(checkpoints["llama"], dtype="float32"))
    coalesced = LLMEngine(
        EngineConfig.create(checkpoints["llama"], dtype="float32", stream_interval=interval)
    )
    ref, outs = _deltas(each, params), _deltas(coalesced, params)
    assert len(ref) == 10 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    for index in (0, 1):
        want = [c for o in ref for c in o.outputs if c.index == index]
        got = [c for o in outs for c in o.outputs if c.index == index]
        sizes = [len(c.token_ids) for c in got]
        rest = 9 % interval
        assert sizes == [1] + [interval] * (9 // interval) + ([rest] if rest else [])
        for field in ("token_ids", "logprobs"):
            assert [x for c in got for x in getattr(c, field)] == [
                x for c in want for x in getattr(c, field)
            ]
        assert "".join(c.text for c in got) == "".join(c.text for c in want)
        assert got[-1].finish_reason == "length"
    with pytest.raises(ConfigError, match="stream_interval must be >= 1"):
        EngineConfig.create(checkpoints["llama"], stream_interval=0)
