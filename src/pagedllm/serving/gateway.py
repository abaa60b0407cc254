"""The OpenAI gateway `pagedllm serve` runs beside tritonserver: `pagedllm openai` as a child
process (:class:`GatewayProcess`), started once Triton is ready, pointed at its gRPC and metrics
ports, its output appended to a log of its own."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pagedllm.serving.ports import port_is_free

DEFAULT_PORT = 9000  # `pagedllm openai`'s
DEFAULT_HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0  # the gateway imports its web stack and loads the tokenizer
STOP_TIMEOUT_S = 10.0  # after the engine's drain: its streams have ended by then


@dataclass(frozen=True)
class GatewayOptions:
    """What `pagedllm serve` passes to its gateway (`pagedllm openai`'s options of the same
    meaning)."""

    port: int = DEFAULT_PORT
    host: str = DEFAULT_HOST
    served_model_name: str | None = None
    chat_template: str | None = None  # a Jinja file overriding the model's template
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"the OpenAI gateway's port must be 1..65535, got {self.port}")

    @property
    def url(self) -> str:
        """Its base URL from this machine (a wildcard address is reached at the loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


def gateway_command(
    options: GatewayOptions, model_dir: str, triton_url: str, metrics_url: str
) -> list[str]:
    """`pagedllm openai` with this interpreter, for the model tritonserver serves."""
    cmd = [sys.executable, "-m", "pagedllm.cli", "openai", f"--triton-url={triton_url}"]
    cmd += [f"--host={options.host}", f"--port={options.port}", f"--model-dir={model_dir}"]
    cmd += [f"--metrics-url={metrics_url}"]
    if options.served_model_name:
        cmd.append(f"--served-model-name={options.served_model_name}")
    if options.chat_template:
        cmd.append(f"--chat-template={Path(options.chat_template).resolve()}")
    if options.trust_request_chat_template:
        cmd.append("--trust-request-chat-template")
    return cmd


def port_in_use(options: GatewayOptions) -> str:
    """Why the gateway could not listen on its address now; "" when it could."""
    host, port = options.host or "0.0.0.0", options.port
    if port_is_free(port, host):
        return ""
    return (
        f"the OpenAI gateway cannot listen on {host}:{port} (in use, or not an address of this "
        "machine): pass --openai-port PORT, or --no-openai"
    )


def log_path_beside(triton_log: Path) -> Path:
    """``x.log`` -> ``x.openai.log``: the gateway's log next to its tritonserver's."""
    return triton_log.with_name(f"{triton_log.stem}.openai.log")


class GatewayProcess:
    """`pagedllm openai` as a child process. It runs in a session of its own (a Ctrl-C at the
    terminal reaches `pagedllm serve` alone, which stops it in order) and gets SIGTERM if this
    process dies (``setpriv --pdeathsig``, following the thread that called :meth:`start`)."""

    def __init__(self, options: GatewayOptions, log_path: Path) -> None:
        self.options = options
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.model_name = ""  # what /v1/models lists, once started
        self._log_start = 0
        self._signalled = False  # a second SIGTERM would make uvicorn drop its streams

    def start(
        self, model_dir: str, triton_url: str, metrics_url: str, stop: threading.Event
    ) -> bool:
        """Launch it and wait until its ``/health`` answers 200 (Triton ready behind it). Returns
        False when ``stop`` was set first; raises RuntimeError (quoting its log) when it exits or
        does not answer within START_TIMEOUT_S."""
        cmd = gateway_command(self.options, model_dir, triton_url, metrics_url)
        if setpriv := shutil.which("setpriv"):  # util-linux
            cmd = [setpriv, "--pdeathsig", "SIGTERM", "--", *cmd]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_start = log.seek(0, os.SEEK_END)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"==== {stamp} pagedllm: starting the OpenAI gateway\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            self._signalled = False
        deadline = time.monotonic() + START_TIMEOUT_S
        while (code := self.process.poll()) is None and time.monotonic() < deadline:
            if self._ready():
                return True
            if stop.wait(0.2):
                return False
        why = "timed out" if code is None else f"failed (exit code {code})"
        self.stop()
        raise RuntimeError(
            f"the OpenAI gateway's start-up {why}; {self.log_path}:\n{self.log_excerpt()}"
        )

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.options.url}/health", timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(f"{self.options.url}/v1/models", timeout=2) as r:
                self.model_name = str(json.load(r)["data"][0]["id"])
            return True
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
            return False

    def log_excerpt(self, lines: int = 20) -> str:
        """The last ``lines`` lines of what this start appended to its log."""
        with contextlib.suppress(OSError), open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])
        return ""

    def exit_code(self) -> int | None:
        """None while it runs (or was never started)."""
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        """SIGTERM (once): it takes no new connections; the requests in flight go on."""
        if self.process is not None and self.process.poll() is None and not self._signalled:
            self._signalled = True
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL its process group. Returns its exit
        code (None if it was not started)."""
        self.terminate()
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
