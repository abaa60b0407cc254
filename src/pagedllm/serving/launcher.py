"""`pagedllm serve`: the model repository on the real tritonserver of the nvidia-pytriton
wheel, on this machine (CPU), until Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import site
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from pagedllm.serving.gateway import (
    GatewayOptions,
    GatewayProcess,
    log_path_beside,
    port_in_use,
)
from pagedllm.serving.pytriton_wheel import prepare_backend_dir
from pagedllm.serving.tritonserver import TritonServer

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
ENSEMBLE_CONFIG = REPO_ROOT / "ensemble_config"
# numpy 1.x for the stub (its bindings break on numpy 2), installed by scripts/setup.sh
STUB_SITE = Path(sys.prefix) / "stub-site"
KEEP_LOGS = 10


def stub_sys_path() -> list[str]:
    if not (STUB_SITE / "numpy").is_dir():
        raise RuntimeError(
            f"missing {STUB_SITE} (numpy<2 for the Triton stub): run `bash scripts/setup.sh`"
        )
    return [str(STUB_SITE), *site.getsitepackages()]


def new_log_file(logs_dir: Path, keep: int = KEEP_LOGS) -> Path:
    """Create ``logs_dir/tritonserver-<date>-<time>-pid<pid>-<random>.log`` for one server (the
    pid is this process's). Of the older logs, the newest ``keep`` stay; the others are deleted
    unless the process that created them still runs (its server may still write there). The
    log of the OpenAI gateway `pagedllm serve` started beside a server (``<name>.openai.log``)
    goes with the server's."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"tritonserver-{time.strftime('%Y%m%d-%H%M%S')}-pid{os.getpid()}-"
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=logs_dir)
    os.close(fd)
    older = sorted(
        p
        for p in logs_dir.glob("tritonserver-*.log")
        if p.name != Path(name).name and not p.name.endswith(".openai.log")
    )
    for old in older[: max(len(older) - keep, 0)]:
        match = re.search(r"-pid(\d+)-", old.name)
        if match is None or not _alive(int(match.group(1))):
            for path in (old, log_path_beside(old)):  # and its gateway's
                path.unlink(missing_ok=True)
    return Path(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process (the pid was reused?): keep the log to be safe
    return True


def make_server(
    model_dir: str,
    *,
    ports: tuple[int, int, int] | None = None,
    dtype: str = "auto",
    quantization: str | None = None,
    work_dir: Path | None = None,
    log_file: Path | None = None,
    log_verbose: int = 0,
    env: dict[str, str] | None = None,
) -> TritonServer:
    """A :class:`TritonServer` for ``model_repository/`` and ``ensemble_config/``, not started.
    ``work_dir`` (default ``~/.cache/pagedllm/triton``) holds ``backends/``, shared by all
    servers, and ``logs/``, where each server gets a log file of its own (:func:`new_log_file`)
    unless ``log_file`` names one (appended to). ``ports``: (HTTP, gRPC, metrics), default free
    ones. `quantization`: llm_engine's (default: its config's, "none"). `env`: more settings for
    the models, e.g. PAGEDLLM_TRACE_FILE (docs/serving.md)."""
    work = work_dir or Path.home() / ".cache" / "pagedllm" / "triton"
    backend = prepare_backend_dir(work / "backends", f"{sys.version_info[0]}.{sys.version_info[1]}")
    log_path = Path(log_file).resolve() if log_file else new_log_file(work / "logs")
    drain_file = Path(tempfile.mkdtemp(prefix="pagedllm-drain-")) / "drain"
    return DrainingServer(
        [MODEL_REPOSITORY, ENSEMBLE_CONFIG],
        backend,
        drain_file=drain_file,
        extra_pythonpath=stub_sys_path(),
        log_path=log_path,
        log_verbose=log_verbose,
        ports=ports,
        env={
            "PAGEDLLM_MODEL_DIR": model_dir,
            "PAGEDLLM_DTYPE": dtype,
            **({"PAGEDLLM_QUANTIZATION": quantization} if quantization else {}),
            "PAGEDLLM_DRAIN_FILE": str(drain_file),
            **(env or {}),
        },
        start_timeout=600.0,
    )


class DrainingServer(TritonServer):
    """A server that drains before it stops. Once Triton has a stop signal it starts no new
    step of an ensemble (its requests get "Server not ready"), so streams in flight could
    neither finish nor end: :meth:`stop` first creates ``drain_file``, which `llm_engine`
    watches (docs/serving.md, Graceful drain) — new requests are refused, those in flight get
    `drain_timeout_s` to finish and are then aborted — waits until no request is left (at
    most ``drain_wait`` s), and only then signals the server."""

    def __init__(self, *args: Any, drain_file: Path, drain_wait: float = 30.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.drain_file = drain_file
        self.drain_wait = drain_wait

    def stop(self) -> int | None:
        if self.process is not None and self.process.poll() is None:
            self.drain_file.touch()
            deadline = time.monotonic() + self.drain_wait
            while not _idle(self.metrics_url) and time.monotonic() < deadline:
                time.sleep(0.1)
        try:
            return super().stop()
        finally:
            with contextlib.suppress(OSError):
                self.drain_file.unlink(missing_ok=True)
                self.drain_file.parent.rmdir()


def _idle(metrics_url: str) -> bool:
    """No request runs or waits in the engine (its vllm:* gauges), or no metrics to read."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return True
    gauges = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M)
    return all(float(v) == 0 for v in gauges)


def serve(
    model_dir: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    dtype: str,
    env: dict[str, str] | None = None,
    log_file: Path | None = None,
    quantization: str | None = None,
    gateway: GatewayOptions | None = None,
) -> int:
    """`pagedllm serve`: tritonserver, then (unless ``gateway`` is None) the OpenAI gateway in
    front of it, until Ctrl-C / SIGTERM. Either failing to start, or exiting, stops the other
    (exit code 1). Stopping: the gateway takes no new connections, the engine drains (streams in
    flight end), then both exit."""
    if gateway is not None and (busy := port_in_use(gateway)):
        print(f"error: {busy}", file=sys.stderr)  # before Triton's minutes of start-up
        return 1
    server = make_server(
        model_dir,
        ports=(http_port, grpc_port, metrics_port),
        dtype=dtype,
        quantization=quantization,
        env=env,
        log_file=log_file,
    )
    openai = GatewayProcess(gateway, log_path_beside(server.log_path)) if gateway else None
    print(f"starting tritonserver with {model_dir} (log: {server.log_path}) ...", flush=True)
    try:
        server.start()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    try:
        code = _run(server, openai, model_dir, stop)
    finally:
        if openai is not None:
            openai.terminate()  # no new connections; its streams end with the drain below
        server.stop()
        if openai is not None:
            openai.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if code == 0:
        print("stopped")
    return code


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _run(
    server: TritonServer, openai: GatewayProcess | None, model_dir: str, stop: threading.Event
) -> int:
    """The gateway's start, then until ``stop`` is set (0) or a process exits (1)."""
    if openai is not None:
        print(f"starting the OpenAI gateway (log: {openai.log_path}) ...", flush=True)
        try:
            if not openai.start(model_dir, server.grpc_url, server.metrics_url, stop):
                return 0
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(ready_message(server, openai), flush=True)
    while not stop.wait(1.0):
        if server.process is not None and server.process.poll() is not None:
            print(f"tritonserver exited; see {server.log_path}", file=sys.stderr)
            return 1
        if openai is not None and (code := openai.exit_code()) is not None:
            print(f"the OpenAI gateway exited ({code}); see {openai.log_path}", file=sys.stderr)
            return 1
    print("stopping ...", flush=True)
    return 0


CHAT_BODY = (
    """'{"model": "%s", "messages": [{"role": "user", "content": "What is the capital of """
    """France?"}], "max_tokens": 32}'"""
)


def ready_message(server: TritonServer, openai: GatewayProcess | None) -> str:
    """What `pagedllm serve` prints once it serves: the endpoints, then commands to try (a chat
    request through the gateway first)."""
    lines = ["ready:"]
    chat = []
    if openai is not None:
        url = openai.options.url
        lines.append(f"  OpenAI  {url}/v1 (model {openai.model_name})")
        chat = [
            f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
            + CHAT_BODY % openai.model_name
        ]
    lines += [
        f"  HTTP    {server.http_url}",
        f"  gRPC    {server.grpc_url}",
        f"  metrics {server.metrics_url}",
        f"  log     {server.log_path}",
    ]
    if openai is not None:
        lines.append(f"  log     {openai.log_path} (the gateway)")
    lines += [
        "",
        "try:",
        *chat,
        f"  curl -sN {server.http_url}/v2/models/ensemble/generate_stream -d "
        """'{"text_input": "Once upon a time,", "max_tokens": 32, "stream": true}'""",
        f"  curl -s {server.http_url}/v2/models/ensemble/generate -d "
        """'{"text_input": "Once upon a time,", "max_tokens": 32, "temperature": 0}'""",
        f"  python -m client.stream --url {server.grpc_url} 'Once upon a time,'",
        "",
        "Ctrl-C stops it.",
    ]
    return "\n".join(lines)
