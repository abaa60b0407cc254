"""Fault isolation: a request the model runner fails on fails alone (the others produce exactly
their tokens, seeded ones included); a fault that is not one request's poisons the engine; the
fault-injection hook costs nothing when off."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TINY, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import RunnerOutput, SchedulerOutput
from pagedllm.engine import LLMEngine
from pagedllm.engine.faults import (
    EngineDeadError,
    FaultInjection,
    InjectedFault,
    RequestFailedError,
    describe,
    is_fatal,
)
from pagedllm.engine.service import EngineService
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind

X = 7  # a prompt holding this token id is the faulty one
VOCAB = TINY["vocab_size"]


def prompt(n: int, seed: int) -> list[int]:
    return [t if t != X else X + 1 for t in random_prompts(1, (n, n), VOCAB, seed=seed)[0]]


def params(temperature: float = 0.0, seed: int | None = None, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=24, ignore_eos=True)


@dataclass
class Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stage: int  # added before this engine step


FAULTY = prompt(40, 100)
FAULTY[30] = X
JOBS = [
    Job("greedy", prompt(12, 1), params(), 0),
    Job("seeded", prompt(30, 2), params(0.8, seed=11), 0),
    Job("short", prompt(5, 3), params(), 0),
    Job("n2", prompt(45, 4), params(1.0, seed=5, n=2), 1),
    Job("greedy2", prompt(20, 5), params(), 2),
    Job("long", prompt(70, 6), params(), 5),  # in chunked prefill when the fault strikes
    Job("faulty", FAULTY, params(), 6),
    # admitted in the faulty request's step, on a prefix-cache hit of blocks it registered
    Job("sharer", FAULTY[:16] + prompt(10, 7), params(0.7, seed=3), 6),
]


def engine(checkpoint: Path, faults: FaultInjection | None = None, **knobs: int) -> LLMEngine:
    config = EngineConfig.create(
        checkpoint, dtype="float32", block_size=8, max_num_batched_tokens=64, **knobs
    )
    return LLMEngine(config, fault_injection=faults)


def run(eng: LLMEngine, jobs: list[Job]) -> dict[str, RequestOutput]:
    """Add each job before its stage's step; step until done; the final outputs by id."""
    pending = sorted(jobs, key=lambda j: j.stage)
    results: dict[str, RequestOutput] = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0].stage <= step:
            job = pending.pop(0)
            eng.add_request(job.request_id, job.prompt, job.params)
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
    return results


def tokens(out: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def spy(eng: LLMEngine) -> list[SchedulerOutput]:
    """Record the steps whose execution raised."""
    failed: list[SchedulerOutput] = []
    recover = eng._recover

    def recording(sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        failed.append(sched)
        return recover(sched, error)

    eng._recover = recording  # type: ignore[method-assign]
    return failed


@pytest.mark.parametrize("num_kv_blocks", [None, 40], ids=["roomy", "preempting"])
def test_faulty_request_fails_alone(
    checkpoints: dict[str, Path], num_kv_blocks: int | None
) -> None:
    ckpt = checkpoints["llama"]
    knobs = {} if num_kv_blocks is None else {"num_kv_blocks": num_kv_blocks}
    expected = run(engine(ckpt, **knobs), [j for j in JOBS if j.request_id != "faulty"])

    eng = engine(ckpt, FaultInjection(fail_on_token=X), **knobs)
    failed_steps = spy(eng)
    got = run(eng, JOBS)

    assert got["faulty"].outputs[0].finish_reason == "abort"
    error = eng.request_errors.pop("faulty")
    assert isinstance(error, RequestFailedError)
    assert str(error) == (
        "request failed in the model runner: InjectedFault: injected fault for request faulty"
    )
    assert not eng.request_errors
    for request_id, out in expected.items():
        assert tokens(got[request_id]) == tokens(out), request_id
        assert all(c.finish_reason == "length" for c in got[request_id].outputs)
    # the fault struck a step with decodes, an unfinished prefill chunk and a prefix hit
    assert len(failed_steps) == 1
    batch = failed_steps[0].scheduled
    assert len(batch) >= 5 and any(s.num_tokens == 1 for s in batch)
    if num_kv_blocks is None:
        assert any(not s.sample for s in batch)  # the faulty request's prefill
        assert {"long", "faulty", "sharer"} <= {s.request_id for s in batch}
        sharer = next(s for s in batch if s.request_id == "sharer")
        assert sharer.start_pos == 16  # its first two blocks came from the faulty one's
    else:
        assert eng.stats().num_preemptions > 0
    eng.check_integrity()
    assert eng.stats().kv_blocks_used == 0
    assert eng.dead_reason is None


def test_offline_llm_reports_the_failed_request(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["llama"]), dtype="float32", block_size=8)
    prompts = [{"prompt_token_ids": prompt(9, 20)}, {"prompt_token_ids": FAULTY}]
    expected = llm.generate(prompts[:1], params(), use_tqdm=False)
    llm._engine = LLMEngine(llm.engine.config, fault_injection=FaultInjection(fail_on_token=X))
    good, bad = llm.generate(prompts, params(), use_tqdm=False)
    assert tokens(good) == tokens(expected[0])
    assert bad.outputs[0].finish_reason == "abort"
    assert isinstance(llm.engine.request_errors[bad.request_id], RequestFailedError)


class Collector:
    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.errors: list[Exception] = []
        self.done = threading.Event()
        self.started = threading.Event()

    def on_output(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        self.started.set()
        if out.finished:
            self.done.set()

    def on_error(self, e: Exception) -> None:
        self.errors.append(e)
        self.done.set()

    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.outputs[0].token_ids]


def delta(p: SamplingParams, max_tokens: int = 24) -> SamplingParams:
    return dataclasses.replace(p, output_kind=RequestOutputKind.DELTA, max_tokens=max_tokens)


def submit(service: EngineService, job: Job, max_tokens: int = 24) -> Collector:
    c = Collector()
    service.submit(
        job.request_id, job.prompt, delta(job.params, max_tokens), c.on_output, c.on_error
    )
    return c


def test_service_fails_only_the_faulty_request(checkpoints: dict[str, Path]) -> None:
    jobs = [j for j in JOBS if j.params.n == 1]
    expected = run(engine(checkpoints["llama"]), [j for j in jobs if j.request_id != "faulty"])
    eng = engine(checkpoints["llama"], FaultInjection(fail_on_token=X))
    service = EngineService(eng).start()
    early = {j.request_id: submit(service, j) for j in jobs if j.stage < 5}
    for c in early.values():  # they are decoding when the faulty one arrives
        assert c.started.wait(60)
    late = {j.request_id: submit(service, j) for j in jobs if j.stage >= 5}
    collectors = early | late
    for c in collectors.values():
        assert c.done.wait(60)
    faulty = collectors.pop("faulty")
    assert len(faulty.errors) == 1 and not faulty.outputs
    assert isinstance(faulty.errors[0], RequestFailedError)
    assert str(faulty.errors[0]).startswith("request failed in the model runner: InjectedFault")
    for request_id, c in collectors.items():
        assert not c.errors, request_id
        assert c.tokens() == tokens(expected[request_id])[0], request_id
    assert service.healthy and service.dead_reason is None
    service.shutdown()
    eng.check_integrity()
    assert eng.stats().kv_blocks_used == 0


def test_poison_fails_everything_and_refuses_new_requests(checkpoints: dict[str, Path]) -> None:
    eng = engine(checkpoints["llama"], FaultInjection(poison_after_steps=6))
    service = EngineService(eng).start()
    cs = [submit(service, Job(f"r{i}", prompt(10 + i, 30 + i), params(), 0), 200) for i in range(4)]
    for c in cs:
        assert c.done.wait(60)
    for c in cs:
        assert len(c.errors) == 1 and isinstance(c.errors[0], EngineDeadError)
        assert "device or engine failure: InjectedFault" in str(c.errors[0])
        assert not c.outputs or not c.outputs[-1].finished
    assert not service.healthy
    assert service.dead_reason is not None and "injected device fault" in service.dead_reason
    late = Collector()
    with pytest.raises(EngineDeadError, match="the engine is dead"):
        service.submit("late", [5, 6], delta(params()), late.on_output, late.on_error)
    service._thread.join(10)
    assert not service._thread.is_alive()
    service.shutdown(timeout=10)
    assert eng.stats().kv_blocks_used == 0
    with pytest.raises(EngineDeadError):
        eng.add_request("later", [5, 6], params())


def failing_execute(
    eng: LLMEngine, fails: Callable[[SchedulerOutput], Exception | None]
) -> list[int]:
    """Make the runner raise `fails(sched)` where it is not None; returns the batch sizes run."""
    execute, sizes = eng._execute, []

    def faulty(sched: SchedulerOutput) -> RunnerOutput:
        sizes.append(len(sched.scheduled))
        error = fails(sched)
        if error is not None:
            raise error
        return execute(sched)

    eng._execute = faulty  # type: ignore[method-assign]
    return sizes


def add(eng: LLMEngine, n: int) -> None:
    for i in range(n):
        eng.add_request(f"r{i}", prompt(6 + i, 40 + i), params())


def step_until_dead(eng: LLMEngine) -> EngineDeadError:
    for _ in range(50):
        try:
            eng.step()
        except EngineDeadError as e:
            return e
    raise AssertionError("the engine was not poisoned")


def test_every_request_failing_alone_poisons(checkpoints: dict[str, Path]) -> None:
    eng = engine(checkpoints["llama"])
    add(eng, 4)
    failing_execute(eng, lambda sched: ValueError("bad kernel"))
    e = step_until_dead(eng)
    assert "every request of a step failed on its own: ValueError: bad kernel" in str(e)
    with pytest.raises(EngineDeadError):
        eng.step()
    with pytest.raises(EngineDeadError):
        eng.add_request("late", [5], params())


def test_device_error_poisons_without_rerunning(checkpoints: dict[str, Path]) -> None:
    eng = engine(checkpoints["llama"])
    add(eng, 3)
    eng.step()
    cuda = RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    sizes = failing_execute(eng, lambda sched: cuda)
    e = step_until_dead(eng)
    assert str(e) == (
        "device or engine failure: RuntimeError: CUDA error: an illegal memory access was "
        "encountered"
    )
    assert sizes == [3]


def test_a_step_that_keeps_failing_poisons(checkpoints: dict[str, Path]) -> None:
    # a fault of the combination: no request fails alone, every step of several fails
    eng = engine(checkpoints["llama"])
    add(eng, 4)
    failing_execute(eng, lambda sched: ValueError("x") if len(sched.scheduled) > 2 else None)
    e = step_until_dead(eng)
    assert "a step failed 3 times in a row" in str(e)


def test_engine_thread_failure_is_not_silent(checkpoints: dict[str, Path]) -> None:
    class Crash(BaseException):
        pass

    eng = engine(checkpoints["llama"])
    service = EngineService(eng).start()
    c = submit(service, Job("r", prompt(8, 50), params(), 0), 200)
    assert c.started.wait(60)

    def crash() -> list[RequestOutput]:
        raise Crash("boom")

    eng.step = crash  # type: ignore[method-assign]
    assert c.done.wait(60)
    assert isinstance(c.errors[0], EngineDeadError)
    assert not service.healthy and "the engine thread failed: Crash: boom" in str(c.errors[0])
    with pytest.raises(EngineDeadError):
        service.submit("late", [5], delta(params()), c.on_output, c.on_error)


def test_hook_off_changes_nothing(checkpoints: dict[str, Path]) -> None:
    assert FaultInjection.parse("") is None and FaultInjection.parse(" , ") is None
    plain = engine(checkpoints["llama"])
    assert plain._execute == plain.runner.execute  # no wrapper: the step calls the runner
    jobs = [j for j in JOBS if j.request_id != "faulty"]
    expected = run(plain, jobs)
    # on, but no prompt holds the token: the same outputs
    hooked = engine(checkpoints["llama"], FaultInjection.parse("fail_on_token=7"))
    got = run(hooked, jobs)
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in expected.items()}
    assert not plain.request_errors and not hooked.request_errors
    assert plain.dead_reason is None and hooked.dead_reason is None


def test_fault_settings_and_messages() -> None:
    f = FaultInjection.parse("fail_on_token=7, poison_after_steps=0")
    assert f == FaultInjection(fail_on_token=7, poison_after_steps=0)
    with pytest.raises(ValueError, match="unknown setting"):
        FaultInjection.parse("fail_on=7")
    with pytest.raises(ValueError, match=">= 0"):
        FaultInjection(fail_on_token=-1)
    assert is_fatal(MemoryError()) and is_fatal(RuntimeError("CUDA out of memory"))
    assert is_fatal(InjectedFault("x", fatal=True)) and not is_fatal(InjectedFault("x"))
    assert not is_fatal(RuntimeError("shape mismatch")) and not is_fatal(ValueError("CUDA"))
    msg = describe(ValueError('bad value in "/work/main/src/pagedllm/x.py", line 3\nTraceback'))
    assert msg == 'ValueError: bad value in "<path>", line 3'
    assert describe(KeyError()) == "KeyError"


def finish(eng: LLMEngine) -> dict[str, list[list[int]]]:
    """Step until done; each finished request's tokens."""
    done: dict[str, list[list[int]]] = {}
    while eng.has_unfinished_requests():
        done.update((out.request_id, tokens(out)) for out in eng.step() if out.finished)
    return done


@pytest.mark.parametrize("where", ["prefill", "forked"])
def test_a_faulty_beam_fails_its_search_alone(checkpoints: dict[str, Path], where: str) -> None:
    ckpt = checkpoints["llama"]
    eng = engine(ckpt)
    add(eng, 2)
    expected = finish(eng)

    beams = prompt(10, 50)
    if where == "prefill":  # the root beam's prompt holds the faulty token
        beams[4] = X
        eng = engine(ckpt, FaultInjection(fail_on_token=X))
    else:
        eng = engine(ckpt)
    add(eng, 2)
    eng.add_beam_search("bs", beams, BeamSearchParams(3, 8, ignore_eos=True))
    if where == "forked":  # a fault of the beams once forked (internal ids "bs#beamN")

        def fault(sched: SchedulerOutput) -> Exception | None:
            late = [s for s in sched.scheduled if s.start_pos >= len(beams) + 2]
            return (
                ValueError("bad beam")
                if any(s.request_id.startswith("bs#") for s in late)
                else None
            )

        failing_execute(eng, fault)
    assert finish(eng) == expected
    error = eng.request_errors.pop("bs")
    assert isinstance(error, RequestFailedError)
    assert str(error).startswith("request failed in the model runner: ")
    assert not eng.request_errors and eng.dead_reason is None
    assert not eng.scheduler.beams.groups and eng.take_beam_search_outputs() == []
    eng.check_integrity()
    assert eng.stats().kv_blocks_used == 0
