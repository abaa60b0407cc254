"""The engine on a background thread: what a Triton `llm_engine` model (or any server) hosts.

Callers on any thread `submit()` and `abort()`; both only enqueue and return at once. The
engine thread adds queued requests, steps the engine while work remains, and hands every
output to its request's callback (on the engine thread: callbacks must be quick; they may call `abort`, which only
enqueues).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.engine.llm_engine import EngineStats, LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]
OnError = Callable[[Exception], None]
# the engine's stats and the histogram observations since the previous call
OnStats = Callable[[EngineStats, list[tuple[str, float]]], None]


@dataclass
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    on_output: OnOutput
    on_error: OnError


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
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._stopping = False
        self._drain = True

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
    ) -> None:
        """Queue a request. A request the engine rejects gets `on_error(ValueError)`."""
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        self._commands.put(_Submit(request_id, prompt, params, on_output, on_error))

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
        stop_seen = False
        while True:
            idle = not self.engine.has_unfinished_requests()
            for cmd in self._pending(wait=idle and not stop_seen):
                if cmd is None:
                    stop_seen = True
                    if not self._drain:
                        for request_id in list(self._callbacks):
                            self._abort(request_id)
                elif isinstance(cmd, _Submit):
                    self._add(cmd)
                else:
                    self._abort(cmd.request_id)
            if self.engine.has_unfinished_requests():
                self._step()
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
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except ValueError as e:
            cmd.on_error(e)
            return
        self._callbacks[cmd.request_id] = (cmd.on_output, cmd.on_error)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._deliver(out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug must not strand every client: fail them all, go on
            logger.exception("engine step failed; failing %d requests", len(self._callbacks))
            for request_id, (_, on_error) in list(self._callbacks.items()):
                self.engine.abort_request(request_id)
                self._callbacks.pop(request_id, None)
                on_error(RuntimeError(f"engine failure: {e}"))
            return
        for out in outputs:
            self._deliver(out)

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
