"""Worker processes that never outlive their parent, and a parent that sees them die.

- Workers are `spawn`ed (never forked: the parent holds threads, CUDA and Triton's IPC) as
  daemon processes, with an explicit Python interpreter: inside a Triton Python-backend stub
  `sys.executable` is the stub, not Python.
- Each worker watches a *death pipe*: the parent holds its only write end, so the worker reads
  EOF the moment the parent exits, however it exits (SIGKILL included), and exits too.
- The parent watches the workers' sentinels on a thread of its own and records the first
  death (`dead_reason`), with the error the worker reported before it went, if any.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import ConfigError

logger = logging.getLogger(__name__)


def python_executable() -> str:
    """The interpreter the workers run: PAGEDLLM_PYTHON (the launcher sets it), else this
    process's own when it is a Python, else python3.X or python3 on PATH."""
    if configured := os.environ.get("PAGEDLLM_PYTHON"):
        return configured
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for name in (version, "python3"):
        if found := shutil.which(name):
            return found
    raise ConfigError("no Python interpreter for the worker processes: set PAGEDLLM_PYTHON")


def watch_parent(death: Connection) -> None:
    """In a worker: exit at once when the parent is gone (its end of `death` closes)."""

    def run() -> None:
        with contextlib.suppress(EOFError, OSError):
            death.recv()
        os._exit(1)  # no cleanup: nothing of this process is wanted once its parent is gone

    threading.Thread(target=run, name="pagedllm-death-pipe", daemon=True).start()


def report(conn: Connection, message: str) -> None:
    """In a worker: tell the parent why it is about to exit."""
    with contextlib.suppress(OSError):
        conn.send(message)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerProcesses:
    """Processes 1..n-1 of a group, each running `target(rank, *args, death, report)`."""

    def __init__(
        self,
        name: str,
        ranks: range,
        target: Callable[..., None],
        args: tuple[Any, ...],
        on_death: Callable[[], None] | None = None,
    ) -> None:
        """`on_death`: called on the monitor thread once a worker is seen dead."""
        ctx = mp.get_context("spawn")
        self.name = name
        self._on_death = on_death
        self._death_r, self._death_w = ctx.Pipe(duplex=False)
        self._reports: dict[int, Connection] = {}
        self.processes: dict[int, mp.process.BaseProcess] = {}
        self._stopping = False
        self.dead_reason: str | None = None
        # the interpreter is a global of multiprocessing's: set for these starts only
        before = mp_spawn.get_executable()
        mp_spawn.set_executable(python_executable())
        try:
            for rank in ranks:
                report_r, report_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=target,
                    args=(rank, *args, self._death_r, report_w),
                    name=f"{name}-{rank}",
                    daemon=True,
                )
                proc.start()
                report_w.close()
                self._reports[rank] = report_r
                self.processes[rank] = proc
        finally:
            mp_spawn.set_executable(before)
        self._death_r.close()  # the workers hold the read end; this one must not keep it open
        self._monitor = threading.Thread(target=self._watch, name=f"{name}-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.pid is not None]

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
        ready = wait(list(sentinels))
        if self._stopping:
            return
        rank = sentinels[ready[0]]  # type: ignore[index]
        proc = self.processes[rank]
        proc.join(0.5)
        reason = f"{self.name} {rank} (pid {proc.pid}) died ({_exit_text(proc.exitcode)})"
        if said := self.reported(rank):
            reason += f": {said}"
        self.dead_reason = reason
        logger.critical("%s", reason)
        if self._on_death is not None:
            self._on_death()

    def reported(self, rank: int) -> str:
        """What worker `rank` reported before it exited ("" if nothing)."""
        conn = self._reports[rank]
        try:
            return str(conn.recv()) if conn.poll(0.1) else ""
        except (EOFError, OSError):
            return ""

    def wait_death(self, timeout: float) -> str | None:
        """`dead_reason`, waiting up to `timeout` seconds for a death to be seen."""
        self._monitor.join(timeout)
        return self.dead_reason

    def stop(self, timeout: float, leaving: bool = False) -> None:
        """Close the death pipe (each worker exits at once), wait up to `timeout` seconds,
        then kill what is left. `leaving`: the workers were told to stop; they get the
        `timeout` to exit on their own first."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        if leaving:
            for proc in self.processes.values():
                proc.join(max(0.0, deadline - time.monotonic()))
        self._death_w.close()
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes.values():
            if proc.is_alive():
                logger.warning("%s did not exit in %.0f s: killing it", proc.name, timeout)
                proc.kill()
                proc.join(5)
        for conn in self._reports.values():
            conn.close()
