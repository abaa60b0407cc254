"""Fault isolation: the errors callers see, which faults break the engine, the search for the
request at fault, and a fault-injection test hook.

When the model runner raises during a step, the scheduler has not applied the step yet.
`LLMEngine` then re-runs the step's requests in halves (`find_culprits`) until the ones that
fail on their own are found; they fail with `RequestFailedError` and the others are recomputed.
A fault that is not one request's (`is_fatal`, every request failing on its own, or the same
requests failing step after step) poisons the engine: `EngineDeadError` from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from pagedllm.core.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput

# they live in pagedllm.errors (the worker processes raise them too); re-exported here
from pagedllm.errors import EngineDeadError as EngineDeadError
from pagedllm.errors import describe as describe

Execute = Callable[[SchedulerOutput], RunnerOutput]


class RequestFailedError(RuntimeError):
    """One request failed in the model runner; the engine and the other requests go on."""


class GrammarFailedError(ValueError):
    """A request's structured-output constraint failed while it ran (it went past the
    grammar engine's limits): the request's fault, not the server's."""


class InjectedFault(RuntimeError):
    """Raised by `FaultInjection` (a test hook); `fatal` ones read as a broken device."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


# messages of RuntimeErrors that mean the device (or its library) is in an unknown state
_DEVICE_ERRORS = ("CUDA", "CUBLAS", "cuBLAS", "CUDNN", "cuDNN", "NCCL", "device-side assert")


def is_fatal(exc: BaseException) -> bool:
    """Whether an exception from the model runner means the device or engine state is broken
    (then no request can be trusted to run): memory exhaustion, errors from CUDA and its
    libraries (out of memory included: conservative), a dead engine."""
    if isinstance(exc, InjectedFault):
        return exc.fatal
    if isinstance(exc, MemoryError | SystemError | EngineDeadError | torch.AcceleratorError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_ERRORS)


def find_culprits(
    batch: Sequence[ScheduledRequest],
    error: Exception,
    run: Callable[[list[ScheduledRequest]], object],
) -> list[tuple[ScheduledRequest, Exception]]:
    """The requests of `batch` (which raised `error` as a whole) that fail on their own, with
    their errors: each half is re-run (`run`) and a failing one is split again, down to single
    requests. Empty when every half passes (a transient fault, or one of the combination).
    A fatal exception from a re-run propagates."""
    if len(batch) == 1:
        return [(batch[0], error)]
    mid = len(batch) // 2
    culprits: list[tuple[ScheduledRequest, Exception]] = []
    for half in (list(batch[:mid]), list(batch[mid:])):
        try:
            run(half)
        except Exception as e:
            if is_fatal(e):
                raise
            culprits += find_culprits(half, e, run)
    return culprits


@dataclass(frozen=True)
class FaultInjection:
    """TEST HOOK — off by default: an engine built without one (`LLMEngine(...,
    fault_injection=None)`, the default) calls the model runner directly and pays nothing.
    With one, a call of the runner's `execute` raises `InjectedFault` before the step runs
    (so the KV of blocks registered for it in the prefix cache is never written):

    - `fail_on_token`: when a request whose prompt contains this token id is in the batch
      (a per-request fault: that request fails, the others go on);
    - `poison_after_steps`: on every call after this many (a fatal device fault: the engine
      is poisoned).

    `parse("fail_on_token=7,poison_after_steps=100")` reads the form a server config takes.
    Never set it in production."""

    fail_on_token: int | None = None
    poison_after_steps: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"fault injection {f.name} must be an int >= 0, got {value!r}")

    @staticmethod
    def parse(spec: str) -> FaultInjection | None:
        """`key=value` pairs separated by commas; an empty string is None (off)."""
        names = {f.name for f in fields(FaultInjection)}
        settings: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in names:
                raise ValueError(
                    f"fault injection: unknown setting {item!r} (known: {sorted(names)})"
                )
            settings[key.strip()] = int(value)
        return FaultInjection(**settings) if settings else None

    def wrap(self, execute: Execute) -> Execute:
        """`execute`, with the faults injected."""
        calls = 0

        def faulty(sched: SchedulerOutput) -> RunnerOutput:
            nonlocal calls
            calls += 1
            if self.poison_after_steps is not None and calls > self.poison_after_steps:
                raise InjectedFault(f"injected device fault (runner call {calls})", fatal=True)
            if self.fail_on_token is not None:
                for s in sched.scheduled:
                    if self.fail_on_token in s.prompt_token_ids:
                        raise InjectedFault(f"injected fault for request {s.request_id}")
            return execute(sched)

        return faulty
