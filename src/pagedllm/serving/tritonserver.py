"""Run a real ``tritonserver`` on a machine without Docker or GPU: its command line and a
supervised process (:class:`TritonServer`). Where the binary comes from and what the Python
backend's stub needs: :mod:`pagedllm.serving.pytriton_wheel`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from pagedllm.serving.ports import free_port, listening_ports, port_is_free
from pagedllm.serving.pytriton_wheel import find_pytriton, server_env

# Optional extra arguments for a GPU-less host: no pinned-memory or NVML/DCGM warnings.
CPU_QUIET_ARGS = ("--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false")


def server_command(
    model_repositories: list[Path],
    backend_dir: Path,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    log_verbose: int = 0,
    *,
    exit_timeout_secs: int = 30,
    server_id: str = "triton",
) -> list[str]:
    """The ``tritonserver`` command line: every endpoint on 127.0.0.1; all models loaded at
    start (``--model-control-mode=none``, the default); exit if one fails to load. On
    SIGINT/SIGTERM the server waits up to ``exit_timeout_secs`` for open HTTP connections,
    in-flight requests and model unloads before it gives up (exit code 1). ``server_id`` is the
    ``name`` that ``GET /v2`` answers. Triton logs to stdout (no ``--log-file``)."""
    cmd = [str(find_pytriton() / "bin" / "tritonserver")]
    cmd += [f"--model-repository={Path(repo).resolve()}" for repo in model_repositories]
    return [
        *cmd,
        f"--id={server_id}",
        f"--backend-directory={Path(backend_dir).resolve()}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics_port}",
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--exit-timeout-secs={exit_timeout_secs}",
        f"--log-verbose={log_verbose}",
    ]


class TritonServer:
    """A ``tritonserver`` child process, used as a context manager::

        with TritonServer([repo, ensembles], backend_dir, extra_pythonpath=paths) as server:
            requests.post(f"{server.http_url}/v2/models/ensemble/generate", json=...)

    Free ports are picked at start (and picked again if one was taken meanwhile); explicit
    ``ports`` that are in use fail the start with an error naming them. The server counts as
    started when ``/v2/health/ready`` answers 200 with its own ``--id`` (not another server's
    on that port) *and* the process itself listens on all three ports (Triton binds the metrics
    port last, after its HTTP endpoint answers), and as failed when it exits first.

    Its stdout and stderr (Triton's log, and what the Python stubs print, crash tracebacks
    included) are *appended* to ``log_path`` (default: a new ``tritonserver.log`` in a
    ``tempfile.mkdtemp`` directory), after a line that marks each start; error messages quote
    only what this start appended. The server runs in its own process group.

    :meth:`stop` sends SIGINT (graceful: in-flight requests finish within ``exit_timeout`` s,
    models' ``finalize()`` run, stubs exit), then SIGKILLs the whole group so no stub outlives
    it. If this process dies without stopping it, the server gets SIGTERM (``setpriv --pdeathsig``; it follows the *thread* that called
    :meth:`start`, so start it from a thread that lives as long as the server).
    """

    def __init__(
        self,
        model_repositories: Sequence[Path],
        backend_dir: Path,
        *,
        extra_pythonpath: Sequence[str] = (),
        log_path: Path | None = None,
        log_verbose: int = 0,
        start_timeout: float = 120.0,
        exit_timeout: int = 30,  # unloading 7 Python models can take 10 s on 2 busy cores
        extra_args: Sequence[str] = (),
        ports: tuple[int, int, int] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_repositories = [Path(p) for p in model_repositories]
        self.backend_dir = Path(backend_dir)
        self.extra_pythonpath = [str(p) for p in extra_pythonpath]
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="tritonserver-")) / "tritonserver.log"
        self.log_path = Path(log_path)
        self._log_start = 0  # where this start's part of the log begins
        self.server_id = f"pagedllm-{os.getpid()}-{secrets.token_hex(4)}"
        self.log_verbose = log_verbose
        self.start_timeout = start_timeout
        self.exit_timeout = exit_timeout
        self.extra_args = list(extra_args)
        self.ports = ports  # (http, grpc, metrics); None: free ones
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0

    @property
    def http_url(self) -> str:
        """``http://127.0.0.1:<port>``: KServe v2 HTTP, ``generate`` and ``generate_stream``."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``127.0.0.1:<port>``, the form ``tritonclient.grpc`` expects (no scheme)."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """``http://127.0.0.1:<port>/metrics`` (Prometheus text)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> None:
        """Launch the server and block until it is ready (see the class docstring)."""
        if self.process is not None:
            raise RuntimeError("server already started")
        env = {**server_env(self.extra_pythonpath), **self.extra_env}
        for _attempt in range(1 if self.ports else 3):
            try:
                busy = self._launch(env)
            except BaseException:
                self.stop()  # also on Ctrl-C while the models load
                raise
            if not busy:
                return
        raise RuntimeError(f"tritonserver cannot listen: {busy}; log {self.log_path}")

    def _launch(self, env: dict[str, str]) -> str:
        """One start. Returns "" when ready, or which ports were in use (then nothing runs);
        raises on any other failure."""
        if self.ports:
            self.http_port, self.grpc_port, self.metrics_port = self.ports
        else:
            ports: set[int] = set()
            while len(ports) < 3:
                ports.add(free_port())
            self.http_port, self.grpc_port, self.metrics_port = sorted(ports)
        cmd = server_command(
            self.model_repositories,
            self.backend_dir,
            self.http_port,
            self.grpc_port,
            self.metrics_port,
            self.log_verbose,
            exit_timeout_secs=self.exit_timeout,
            server_id=self.server_id,
        )
        setpriv = shutil.which("setpriv")  # util-linux
        if setpriv:
            cmd = [setpriv, "--pdeathsig", "SIGTERM", "--", *cmd]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_start = log.seek(0, os.SEEK_END)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(
                f"==== {stamp} pagedllm: starting {self.server_id}: HTTP {self.http_port}"
                f", gRPC {self.grpc_port}, metrics {self.metrics_port}\n".encode()
            )
            log.flush()
            if busy := self._ports_in_use():
                return self._note(busy)
            self.process = subprocess.Popen(
                cmd + self.extra_args,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group, shared with the stubs
            )
        deadline = time.monotonic() + self.start_timeout
        while (code := self.process.poll()) is None and time.monotonic() < deadline:
            if self.is_ready() and self._listens():
                return ""
            time.sleep(0.1)
        self.stop()
        if busy := self._ports_in_use():  # taken by someone else after the check above
            return self._note(busy)
        why = "timed out" if code is None else f"failed (exit code {code})"
        raise RuntimeError(f"tritonserver start-up {why}; {self.log_path}:\n{self.log_excerpt()}")

    def _ports_in_use(self) -> str:
        named = {"HTTP": self.http_port, "gRPC": self.grpc_port, "metrics": self.metrics_port}
        busy = [
            f"127.0.0.1:{port} ({name})" for name, port in named.items() if not port_is_free(port)
        ]
        return f"{', '.join(busy)} already in use" if busy else ""

    def _note(self, message: str) -> str:
        with open(self.log_path, "a") as log:
            log.write(f"pagedllm: {message}\n")
        return message

    def _listens(self) -> bool:
        """Whether the server process itself listens on its three ports (true where the OS
        cannot tell: then readiness and the ``--id`` decide alone)."""
        assert self.process is not None
        ports = listening_ports(self.process.pid)
        return ports is None or {self.http_port, self.grpc_port, self.metrics_port} <= ports

    def log_excerpt(self, lines: int = 30) -> str:
        """The error lines (``E...``) of what the last start appended to the log, then its last
        ``lines`` lines."""
        text: list[str] = []
        with contextlib.suppress(OSError), open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            text = log.read().decode(errors="replace").splitlines()
        errors = [ln for ln in text if re.match(r"E\d{4} ", ln) and "CUDA" not in ln.upper()]
        return "\n".join([*errors[:20], "...", *text[-lines:]])

    def is_ready(self) -> bool:
        """True when ``GET /v2/health/ready`` answers 200 (all models loaded) and ``GET /v2``
        names this server (not another one on the same port). A stub that crashes later does
        *not* make the server or its model unready."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as resp:
                if resp.status != 200:
                    return False
            with urllib.request.urlopen(f"{self.http_url}/v2", timeout=2) as resp:
                return bool(json.load(resp).get("name") == self.server_id)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self) -> int | None:
        """SIGINT, wait up to ``exit_timeout`` + 10 s, then SIGKILL the whole process group.
        Returns the server's exit code (``None`` if it was not running)."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.exit_timeout + 10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers (stubs) of the group
        return proc.wait()

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
