"""Two (or more) replicas behind a real router, on this machine: each replica is `pagedllm serve`
(tritonserver with the model repository) and `pagedllm openai` (its gateway), both as
subprocesses on free ports; the router is `smg launch` (SGLang Model Gateway, PyPI `smg`) with
the gateways as its workers (docs/routing.md). Used by tests/test_router.py and
benchmarks/router_bench.py. Everything stops on exit, killed if it does not stop in time, and
`Cluster.pids()` lets a caller check that no process is left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from server_metrics import metrics

from pagedllm.serving.ports import free_port

# the router's health checks, retries and circuit breaker, tuned so that a dead worker is
# noticed within seconds (smg's defaults: a check every 60 s, a breaker after 10 failures)
ROUTER_ARGS = (
    "--health-check-interval-secs=1",
    "--health-check-timeout-secs=2",
    "--health-failure-threshold=2",
    "--health-success-threshold=1",
    "--cb-failure-threshold=2",
    "--cb-timeout-duration-secs=30",
    "--retry-max-retries=5",
    "--retry-initial-backoff-ms=100",
    "--retry-max-backoff-ms=2000",
    "--request-timeout-secs=120",
)


MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 60.0  # per request: none may take longer, whatever happens to the replicas


SHM_PREFIX = "triton_python_backend_shm_region_"


def completion(url: str, prompt: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """One greedy completion (`max_tokens` 16 unless `extra` says): {"status", "text",
    "finish", "error", "ttft", "seconds"} (ttft: seconds to the first text a client sees). A
    streamed one is joined from its events; an `error` event, a stream that ends without
    [DONE] or a connection the server drops is an error."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    body |= {"stream": stream, **extra}
    out: dict[str, Any] = {"status": None, "text": None, "finish": None, "error": None}
    start = time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = json.loads(r.read())["error"]["message"]
            elif not stream:
                choice = json.loads(r.read())["choices"][0]
                out.update(text=choice["text"], finish=choice["finish_reason"])
                out["ttft"] = time.monotonic() - start
            else:
                _read_events(r, out, start)
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    return out


def _read_events(r: httpx.Response, out: dict[str, Any], start: float) -> None:
    text, done = "", False
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            out["error"] = chunk["error"]["message"]
            continue
        if "ttft" not in out and chunk["choices"][0]["text"]:
            out["ttft"] = time.monotonic() - start
        text += chunk["choices"][0]["text"]
        out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]
    out["text"] = text
    if not done and out["error"] is None:
        out["error"] = "stream ended without [DONE]"


def get_json(url: str, timeout: float = 5) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def _wait(ok: object, what: str, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            if ok():  # type: ignore[operator]
                return
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'exited: ' + str(dead) if dead else 'timed out'}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes], sig: int, wait: float) -> None:
    """`sig` to the process, SIGKILL to its group if it has not exited after `wait` s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tree(proc: subprocess.Popen[bytes] | None) -> list[psutil.Process]:
    if proc is None or proc.poll() is not None:
        return []
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    return []


def _shm_files(procs: list[psutil.Process]) -> set[str]:
    """The Python backend's shared-memory files of these processes: each stub is given its
    region's name on its command line; tritonserver maps them."""
    found = set()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            found |= {m.path for m in p.memory_maps(grouped=True)}
            found |= {f"/dev/shm/{a}" for a in p.cmdline() if a.startswith(SHM_PREFIX)}
    return {f for f in found if f.startswith(f"/dev/shm/{SHM_PREFIX}")}


@dataclass
class Replica:
    """`pagedllm serve` + `pagedllm openai` in front of it."""

    name: str
    log_dir: Path
    model_dir: str | None = None  # None: the default model, as `pagedllm serve` picks it
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    gateway_port: int = field(default_factory=free_port)
    serve: subprocess.Popen[bytes] | None = None
    gateway: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def metrics(self) -> dict[str, float]:
        """The engine's vllm:* samples on this replica's Triton metrics port."""
        return metrics(self.metrics_url)

    def finished(self) -> float:
        """Requests this replica's engine has finished (any reason): where requests went."""
        return sum(v for k, v in self.metrics().items() if k.startswith("vllm:request_success"))

    def launch(self) -> None:
        """Start both processes (not waiting for them: see :meth:`wait_ready`)."""
        cli = [sys.executable, "-m", "pagedllm.cli"]
        model = ["--model", self.model_dir] if self.model_dir else []
        ports = [f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}"]
        ports += [f"--metrics-port={self.metrics_port}"]
        # the gateway apart (`--no-openai`): this file runs and kills the two on their own
        self.serve = self._spawn([*cli, "serve", "--no-openai", *model, *ports], "serve")
        grpc = f"127.0.0.1:{self.grpc_port}"
        model_dir = ["--model-dir", self.model_dir] if self.model_dir else []
        gateway = ["openai", "--triton-url", grpc, "--port", str(self.gateway_port), *model_dir]
        self.gateway = self._spawn([*cli, *gateway], "gateway")

    def _spawn(self, cmd: list[str], what: str) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{self.name}-{what}.log", "ab") as log:
            return subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout: float = 600) -> None:
        """Until the gateway's /health says Triton serves the ensemble."""
        procs = [p for p in (self.serve, self.gateway) if p is not None]
        _wait(lambda: get_json(f"{self.url}/health", 2), f"replica {self.name}", timeout, procs)

    def pids(self) -> set[int]:
        return {p.pid for proc in (self.serve, self.gateway) for p in _tree(proc)}

    def kill(self) -> set[str]:
        """A crash: SIGKILL to the gateway, `pagedllm serve`, tritonserver and its stubs. The
        shared-memory files of the Python backend are removed after them (a killed tritonserver
        cannot); returns their paths."""
        procs = [p for proc in (self.gateway, self.serve) for p in _tree(proc)]
        shm = _shm_files(procs)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        for proc in (self.gateway, self.serve):
            if proc is not None:
                proc.wait()
        for path in shm:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return shm

    def stop(self) -> None:
        """`pagedllm serve` drains and stops tritonserver on SIGINT; the gateway on SIGTERM.
        Whatever of them is left after that (tritonserver has a process group of its own) is
        killed."""
        procs = [p for proc in (self.gateway, self.serve) for p in _tree(proc)]
        if self.gateway is not None:
            _stop(self.gateway, signal.SIGTERM, 10)
        if self.serve is not None:
            _stop(self.serve, signal.SIGINT, 60)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=10)


@dataclass
class Router:
    """`smg launch` over the replicas' gateways."""

    workers: list[str]
    policy: str
    log_dir: Path
    port: int = field(default_factory=free_port)
    prometheus_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> None:
        cmd = [sys.executable, "-m", "smg", "launch", "--host=127.0.0.1", f"--port={self.port}"]
        cmd += ["--worker-urls", *self.workers, f"--policy={self.policy}"]
        cmd += ["--prometheus-host=127.0.0.1", f"--prometheus-port={self.prometheus_port}"]
        cmd += [*ROUTER_ARGS, "--log-level=warn"]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"router-{self.policy}-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        _wait(lambda: all(self.healthy().values()), "router", timeout, [self.proc])

    def healthy(self) -> dict[str, bool]:
        """The router's own view of its workers: URL -> healthy (its `/workers`)."""
        answer = get_json(f"{self.url}/workers", 2)
        assert isinstance(answer, dict)
        found = {w["url"]: bool(w["is_healthy"]) for w in answer["workers"]}
        return found if set(found) == set(self.workers) else {}

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc, signal.SIGTERM, 10)

    def pids(self) -> set[int]:
        return {p.pid for p in _tree(self.proc)}


@dataclass
class Cluster:
    replicas: list[Replica]
    router: Router

    def pids(self) -> set[int]:
        return self.router.pids().union(*(r.pids() for r in self.replicas))

    def restart_router(self, policy: str) -> Router:
        """Another router (another policy) over the same replicas; the old one is stopped."""
        self.router.stop()
        self.router = Router(self.router.workers, policy, self.router.log_dir)
        self.router.start()
        return self.router


@contextmanager
def running_cluster(
    log_dir: Path,
    policy: str = "cache_aware",
    n: int = 2,
    model_dir: str | None = None,
    graceful: bool = True,
) -> Iterator[Cluster]:
    """`n` replicas and a router; all stopped on exit, as `pagedllm serve` stops on Ctrl-C
    (about 15 s: Triton unloads its models) or, not `graceful`, killed (2 s). The replicas
    start one after the other: side by side, their 14 Python stubs importing torch at once on
    2 cores take far longer."""
    replicas = [Replica(f"replica{i}", log_dir, model_dir) for i in range(n)]
    cluster = Cluster(replicas, Router([r.url for r in replicas], policy, log_dir))
    try:
        for r in replicas:
            r.launch()
            r.wait_ready()
        cluster.router.start()
        yield cluster
    finally:
        cluster.router.stop()
        stops = [threading.Thread(target=r.stop if graceful else r.kill) for r in replicas]
        for t in stops:
            t.start()
        for t in stops:
            t.join()
