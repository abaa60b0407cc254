"""The engine on a background thread: what a Triton `llm_engine` model (or any server) hosts.

Callers on any thread `submit()` and `abort()`; both only enqueue and return at once. The
engine thread adds queued requests, steps the engine while work remains, and hands every
output to its request's callback (on the engine thread: callbacks must be quick; they may call
`abort`, which only enqueues).

Faults (`engine.faults`): a request the model runner fails on gets `on_error(RequestFailedError)`
and the others go on. A fault that is not one request's, or any other failure of the engine
thread, poisons the service: every request in flight gets `on_error(EngineDeadError)`,
`healthy` turns False (`dead_reason` says why) and `submit` raises EngineDeadError.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.beam_search import BeamSearchParams, BeamSearchSequence
from pagedllm.engine.faults import EngineDeadError, describe
from pagedllm.engine.llm_engine import EngineStats, LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["EngineDeadError", "EngineService"]

logger = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]
OnError = Callable[[Exception], None]
# a beam search's beams, best first: every live one after each step (finished False), then
# the final ranking (True; on abort, the live beams with finish_reason "abort")
OnBeams = Callable[[list[BeamSearchSequence], bool], None]
# the engine's stats and the histogram observations since the previous call
OnStats = Callable[[EngineStats, list[tuple[str, float]]], None]


@dataclass
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | BeamSearchParams
    on_output: OnOutput | OnBeams
    on_error: OnError
    lora_request: LoRARequest | None = None


@dataclass
class _Beams:
    on_beams: OnBeams
    on_error: OnError
    steps: int = 0  # the group's steps already delivered


@dataclass
class _Abort:
    request_id: str


class EngineService:
    def __init__(self, engine: LLMEngine, on_stats: OnStats | None = None) -> None:
        """`on_stats` (optional) gets the engine's stats on the engine thread whenever they
        changed after a step or a command (for metrics)."""
        self.engine = engine
        self._on_stats = on_stats
        self._last_stats: EngineStats | None = None
        self._commands: queue.SimpleQueue[_Submit | _Abort | None] = queue.SimpleQueue()
        self._callbacks: dict[str, tuple[OnOutput, OnError]] = {}
        self._beams: dict[str, _Beams] = {}  # beam searches in flight
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._stopping = False
        self._drain = True
        # set once, on the engine thread, under the lock (so no submit is queued after the
        # thread's last look at the queue)
        self._lock = threading.Lock()
        self._dead_reason: str | None = None

    @property
    def healthy(self) -> bool:
        """False once the engine is poisoned or its thread failed: it serves nothing more."""
        return self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the service is not healthy (None while it is)."""
        return self._dead_reason

    def start(self) -> EngineService:
        self._thread.start()
        return self

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        on_output: OnOutput,
        on_error: OnError,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (on a LoRA adapter if `lora_request`). A request the engine rejects gets `on_error(ValueError)`, one the
        model runner fails on `on_error(RequestFailedError)`, and every request in flight when
        the engine is poisoned `on_error(EngineDeadError)`. Raises EngineDeadError at once when
        the service is not `healthy`, RuntimeError when it is shutting down."""
        with self._lock:
            if self._dead_reason is not None:
                raise EngineDeadError(f"the engine is dead: {self._dead_reason}")
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            cmd = _Submit(request_id, prompt, params, on_output, on_error, lora_request)
            self._commands.put(cmd)

    def submit_beam_search(
        self,
        request_id: str,
        prompt: str | list[int],
        params: BeamSearchParams,
        on_beams: OnBeams,
        on_error: OnError,
    ) -> None:
        """Queue a beam search (`LLMEngine.add_beam_search`): `on_beams` gets every live beam
        after each step, then the final ranking; errors as `submit`'s."""
        self.submit(request_id, prompt, params, on_beams, on_error)  # type: ignore[arg-type]

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op if it already finished); its blocks are freed at the engine
        thread's next turn, and its callback gets a final output with finish_reason abort."""
        self._commands.put(_Abort(request_id))

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; finish (drain=True) or abort the ones in flight; join."""
        self._stopping = True
        self._drain = drain
        self._commands.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # never die silently
            logger.critical("the engine thread failed", exc_info=e)
            self._poison(f"the engine thread failed: {describe(e)}")

    def _loop(self) -> None:
        stop_seen = False
        while True:
            if (why := self.engine.runner.dead_reason) is not None:  # a worker died
                self._poison(why)
                return
            idle = not self.engine.has_unfinished_requests()
            for cmd in self._pending(wait=idle and not stop_seen):
                if cmd is None:
                    stop_seen = True
                    if not self._drain:
                        for request_id in [*self._callbacks, *self._beams]:
                            self._abort(request_id)
                elif isinstance(cmd, _Submit):
                    self._add(cmd)
                else:
                    self._abort(cmd.request_id)
            if self.engine.has_unfinished_requests() and not self._step():
                return
            self._report()
            if stop_seen and not self.engine.has_unfinished_requests():
                return

    def _report(self) -> None:
        if self._on_stats is None:
            return
        stats = self.engine.stats()
        observations = self.engine.metrics.drain() if self.engine.metrics else []
        if stats != self._last_stats or observations:
            self._last_stats = stats
            try:
                self._on_stats(stats, observations)
            except Exception:
                logger.exception("stats callback failed")

    def _pending(self, wait: bool) -> list[_Submit | _Abort | None]:
        """Every queued command; when idle, wait (briefly) for the first one."""
        cmds: list[_Submit | _Abort | None] = []
        try:
            cmds.append(self._commands.get(timeout=0.5) if wait else self._commands.get_nowait())
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            return cmds

    def _add(self, cmd: _Submit) -> None:
        beams = isinstance(cmd.params, BeamSearchParams)
        try:
            if isinstance(cmd.params, BeamSearchParams):
                self.engine.add_beam_search(cmd.request_id, cmd.prompt, cmd.params)
            else:
                lora = cmd.lora_request
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, lora_request=lora)
        except ValueError as e:
            _call(cmd.on_error, e)
            return
        except Exception as e:  # a bug met by one request: that request fails, not the engine
            logger.exception("adding request %s failed", cmd.request_id)
            _call(cmd.on_error, e)
            return
        if beams:
            self._beams[cmd.request_id] = _Beams(cmd.on_output, cmd.on_error)  # type: ignore[arg-type]
        else:
            self._callbacks[cmd.request_id] = (cmd.on_output, cmd.on_error)  # type: ignore[assignment]

    def _abort(self, request_id: str) -> None:
        if (beams := self._beams.pop(request_id, None)) is not None:
            group = self.engine.scheduler.beams.groups.get(request_id)
            live = [] if group is None else group.live_sequences()
            self.engine.abort_request(request_id)
            for seq in live:
                seq.finish_reason = "abort"
            _deliver_beams(beams, live, True)
            return
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._deliver(out)

    def _step(self) -> bool:
        """One engine step; False when it poisoned the engine."""
        try:
            outputs = self.engine.step()
        except EngineDeadError as e:
            self._poison(str(e))
            return False
        except Exception as e:  # outside the model runner: the engine's state is unknown
            logger.critical("engine step failed", exc_info=e)
            self._poison(f"engine step failed: {describe(e)}")
            return False
        if self.engine.request_errors:
            self._fail_requests()
        for out in outputs:
            self._deliver(out)
        self._poll_beams()
        return True

    def _poll_beams(self) -> None:
        """Beam searches report no outputs from step(): each one that advanced gets its live
        beams, each one that finished its final ranking."""
        if not self._beams:
            return
        groups = self.engine.scheduler.beams.groups
        for request_id, beams in self._beams.items():
            group = groups.get(request_id)
            if group is not None and group.num_steps > beams.steps:
                beams.steps = group.num_steps
                _deliver_beams(beams, group.live_sequences(), False)
        for request_id, output in self.engine.take_beam_search_outputs():
            if (done := self._beams.pop(request_id, None)) is not None:
                _deliver_beams(done, output.sequences, True)

    def _fail_requests(self) -> None:
        for request_id, error in self.engine.request_errors.items():
            callbacks = self._callbacks.pop(request_id, None)
            if callbacks is not None:
                _call(callbacks[1], error)
            if (beams := self._beams.pop(request_id, None)) is not None:
                _call(beams.on_error, error)
        self.engine.request_errors.clear()

    def _poison(self, reason: str) -> None:
        """Fail every request in flight or queued; from now on `submit` raises."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = reason
        error = EngineDeadError(f"the engine is dead: {self._dead_reason}")
        logger.critical("failing %d requests: %s", len(self._callbacks), error)
        failing = [(r, cb[1]) for r, cb in self._callbacks.items()]
        failing += [(r, b.on_error) for r, b in self._beams.items()]
        self._callbacks.clear()
        self._beams.clear()
        for request_id, on_error in failing:
            try:  # frees its blocks; the engine may be too broken for it
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of request %s failed", request_id)
            _call(on_error, error)
        for cmd in self._pending(wait=False):
            if isinstance(cmd, _Submit):
                _call(cmd.on_error, error)

    def _deliver(self, out: RequestOutput) -> None:
        callbacks = self._callbacks.get(out.request_id)
        if callbacks is None:
            return
        if out.finished:
            del self._callbacks[out.request_id]
        try:
            callbacks[0](out)
        except Exception:
            logger.exception("output callback of request %s failed", out.request_id)


def _deliver_beams(beams: _Beams, sequences: list[BeamSearchSequence], finished: bool) -> None:
    try:
        beams.on_beams(sequences, finished)
    except Exception:
        logger.exception("beam search callback failed")


def _call(on_error: OnError, error: Exception) -> None:
    try:
        on_error(error)
    except Exception:
        logger.exception("error callback failed")
