"""The engine on its background thread: requests from several threads, streaming callbacks,
errors, aborts and shutdown — nothing lost, nothing leaked."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from conftest import TINY, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams, BeamSearchSequence
from pagedllm.engine.service import EngineService
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind


class Collector:
    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.errors: list[Exception] = []
        self.done = threading.Event()

    def on_output(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        if out.finished:
            self.done.set()

    def on_error(self, e: Exception) -> None:
        self.errors.append(e)
        self.done.set()


def delta(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )


@pytest.fixture
def llm(checkpoints: dict[str, Path]) -> LLM:
    return LLM(str(checkpoints["llama"]), block_size=8)


def test_concurrent_submitters_get_their_own_streams(llm: LLM) -> None:
    prompts = random_prompts(12, (5, 40), TINY["vocab_size"], seed=31)
    expected = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], delta(16), use_tqdm=False)
    ]
    service = EngineService(llm.engine).start()
    collectors = [Collector() for _ in prompts]

    def submit(i: int) -> None:
        service.submit(
            f"r{i}", prompts[i], delta(16), collectors[i].on_output, collectors[i].on_error
        )

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in collectors:
        assert c.done.wait(60)
    for c, exp in zip(collectors, expected, strict=True):
        assert not c.errors
        assert [t for o in c.outputs for t in o.outputs[0].token_ids] == exp
        assert len(c.outputs) == 16 and c.outputs[-1].finished
    service.shutdown()
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0


def test_rejected_request_gets_an_error_and_others_run(llm: LLM) -> None:
    service = EngineService(llm.engine).start()
    bad, good = Collector(), Collector()
    service.submit("bad", [], delta(4), bad.on_output, bad.on_error)
    service.submit("good", [5, 6, 7], delta(4), good.on_output, good.on_error)
    assert bad.done.wait(30) and good.done.wait(30)
    assert isinstance(bad.errors[0], ValueError) and "empty" in str(bad.errors[0])
    assert not bad.outputs and good.outputs[-1].finished
    service.shutdown()


def test_abort_mid_stream_frees_blocks(llm: LLM) -> None:
    service = EngineService(llm.engine).start()
    c = Collector()
    started = threading.Event()

    def on_output(out: RequestOutput) -> None:
        c.on_output(out)
        started.set()

    service.submit("long", [5, 6, 7] * 10, delta(400), on_output, c.on_error)
    assert started.wait(30)
    service.abort("long")
    assert c.done.wait(30)
    assert c.outputs[-1].finished and c.outputs[-1].outputs[0].finish_reason == "abort"
    assert len(c.outputs) < 400
    service.shutdown()
    assert llm.engine.stats().kv_blocks_used == 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("drain", [True, False])
def test_shutdown_drains_or_aborts(llm: LLM, drain: bool) -> None:
    service = EngineService(llm.engine).start()
    cs = [Collector() for _ in range(3)]
    for i, c in enumerate(cs):
        service.submit(f"r{i}", [5 + i, 6, 7], delta(30 if drain else 400), c.on_output, c.on_error)
    service.shutdown(drain=drain, timeout=60)
    assert not service._thread.is_alive()
    reasons = [c.outputs[-1].outputs[0].finish_reason for c in cs]
    assert reasons == ["length" if drain else "abort"] * 3
    assert all(c.outputs[-1].finished for c in cs)  # every client got a final response
    assert llm.engine.stats().kv_blocks_used == 0
    with pytest.raises(RuntimeError, match="shutting down"):
        service.submit("late", [5], delta(1), cs[0].on_output, cs[0].on_error)


def test_beam_search_streams_every_step_and_aborts(llm: LLM) -> None:
    """Beam searches report no outputs from step(): the service polls their groups."""
    prompt = [5, 6, 7, 8]
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    (expected,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    service = EngineService(llm.engine).start()
    updates: list[tuple[list[BeamSearchSequence], bool]] = []
    done = threading.Event()

    def on_beams(seqs: list[BeamSearchSequence], finished: bool) -> None:
        updates.append((seqs, finished))
        if finished:
            done.set()

    service.submit_beam_search("b", prompt, params, on_beams, lambda e: done.set())
    assert done.wait(60)
    assert [len(s[0].tokens) - len(prompt) for s, _ in updates] == [1, 2, 3, 4, 5]
    assert [f for _, f in updates] == [False] * 4 + [True]
    assert [s.tokens for s in updates[-1][0]] == [s.tokens for s in expected.sequences]
    done.clear()
    long = BeamSearchParams(beam_width=2, max_tokens=400, ignore_eos=True)
    updates.clear()
    service.submit_beam_search("long", prompt, long, on_beams, lambda e: done.set())
    while not updates:
        time.sleep(0.01)
    service.abort("long")
    assert done.wait(30)
    assert updates[-1][1] and {s.finish_reason for s in updates[-1][0]} == {"abort"}
    service.shutdown()
    assert llm.engine.stats().kv_blocks_used == 0
    llm.engine.check_integrity()
