"""Graceful drain on a real tritonserver: when the server is stopped (`pagedllm serve`'s
stop: the drain file), new requests are refused, those in flight get `drain_timeout_s` to
finish and then end as aborted (finish_reason "abort") — before Triton's own exit timeout —
and the server exits 0.
Unloading `llm_engine` (model control API) lets the request in flight finish, as Triton does;
unloading and reloading it under load, five times, loses no request and leaks no threads,
processes, file descriptors or KV blocks."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import server_metrics
from test_isolation import long_request, wait_running
from test_server import GrpcStream, post

from pagedllm.serving.tritonserver import TritonServer

DRAIN = 2.0  # seconds (drain_timeout_s)


def make(ckpt: Path, work: Path, *extra_args: str) -> TritonServer:
    from pagedllm.serving.launcher import make_server

    server = make_server(
        str(ckpt), dtype="float32", work_dir=work, env={"PAGEDLLM_DRAIN_TIMEOUT_S": str(DRAIN)}
    )
    server.extra_args = list(extra_args)
    server.exit_timeout = 30  # Triton's own: longer than the drain and the models' unloading
    return server


def test_stopping_drains_in_flight_requests_and_exits_0(
    slow_checkpoint: Path, tmp_path: Path
) -> None:
    server = make(slow_checkpoint, tmp_path)
    server.start()
    try:
        long = GrpcStream(server, {**long_request(), "stream": True})
        wait_running(server, 1)
        exit_code: list[int | None] = []
        stopper = threading.Thread(target=lambda: exit_code.append(server.stop()))
        stopped_at = time.monotonic()
        stopper.start()  # what `pagedllm serve` does on Ctrl-C / SIGTERM
        time.sleep(0.5)
        status, text = post(f"{server.http_url}/v2/models/ensemble/generate", long_request())
        assert status == 400 and "the engine is shutting down" in text, text  # no new ones
        assert long.done.wait(DRAIN + 5), "the request was not ended by the drain"
        ended_after = time.monotonic() - stopped_at
        long.client.stop_stream()
        assert long.error is None
        assert long.responses[-1][1]["finish_reason"] == "abort"  # it streamed until then
        assert DRAIN - 0.5 < ended_after < DRAIN + 3
        stopper.join(30)
        assert exit_code == [0]
    finally:
        server.stop()


def repository(server: TritonServer, action: str) -> int:
    url = f"{server.http_url}/v2/repository/models/llm_engine/{action}"
    request = urllib.request.Request(url, data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=120) as r:
        return int(r.status)


def resources(server: TritonServer) -> dict[str, int]:
    """The server process's open fds and threads, and its child processes (stubs)."""
    assert server.process is not None
    pid = server.process.pid
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads")))
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {
        "fds": len(list(Path(f"/proc/{pid}/fd").iterdir())),
        "threads": threads,
        "children": len(children),
    }


@pytest.fixture
def explicit_server(slow_checkpoint: Path, tmp_path: Path) -> Iterator[TritonServer]:
    server = make(slow_checkpoint, tmp_path, "--model-control-mode=explicit", "--load-model=*")
    with server:
        yield server


def test_unload_and_reload_under_load_five_times_leaks_nothing(
    explicit_server: TritonServer,
) -> None:
    server = explicit_server
    good = {"text_input": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, text = post(f"{server.http_url}/v2/models/ensemble/generate", good)
    assert status == 200, text
    expected = json.loads(text)["text_output"]
    outcomes: list[int] = []
    stop = threading.Event()

    def load() -> None:  # a client that keeps sending while the engine comes and goes
        while not stop.is_set():
            outcomes.append(post(f"{server.http_url}/v2/models/ensemble/generate", good)[0])

    clients = [threading.Thread(target=load) for _ in range(2)]
    for c in clients:
        c.start()
    samples = []
    try:
        for _ in range(5):
            long = GrpcStream(server, {**long_request(max_tokens=32), "stream": True})
            # its first token: it runs in the engine (a running count of 1 may be a client's)
            deadline = time.monotonic() + 60
            while not long.responses:
                assert time.monotonic() < deadline and long.error is None, long.error
                time.sleep(0.002)
            assert repository(server, "unload") == 200
            assert long.done.wait(60)  # it finishes: an unload waits for the requests in flight
            long.client.stop_stream()
            assert long.error is None and long.responses[-1][1]["finish_reason"] == "length"
            assert repository(server, "load") == 200
            status, text = post(f"{server.http_url}/v2/models/ensemble/generate", good)
            assert status == 200 and json.loads(text)["text_output"] == expected, text
            server_metrics.wait_idle(server.metrics_url, timeout=30)
            samples.append(resources(server))
    finally:
        stop.set()
        for c in clients:
            c.join(60)
    # while the engine is away: refused with a message (400 "shutting down", 404 unknown model)
    assert 200 in outcomes and all(s in (200, 400, 404, 503) for s in outcomes), set(outcomes)
    first, last = samples[1], samples[-1]  # (the first reload warms caches up)
    assert last["children"] == first["children"]
    assert last["threads"] <= first["threads"] + 2, samples
    assert last["fds"] <= first["fds"] + 8, samples


def test_the_container_command_drains_on_sigterm(slow_checkpoint: Path, tmp_path: Path) -> None:
    """docker/serve.sh, the image's command, run here with the wheel's tritonserver."""
    import os
    import subprocess

    from pagedllm.serving.launcher import ENSEMBLE_CONFIG, MODEL_REPOSITORY, stub_sys_path
    from pagedllm.serving.pytriton_wheel import find_pytriton, prepare_backend_dir, server_env
    from pagedllm.serving.tritonserver import free_port, server_command

    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(free_port())
    http, grpc, metrics = sorted(ports)
    backend = prepare_backend_dir(tmp_path / "backends")
    server = TritonServer([], backend)  # only for its URLs and readiness check
    server.http_port, server.grpc_port, server.metrics_port = http, grpc, metrics
    argv = server_command(
        [MODEL_REPOSITORY, ENSEMBLE_CONFIG],
        backend,
        http,
        grpc,
        metrics,
        server_id=server.server_id,
    )
    env = server_env(stub_sys_path())
    env.update(
        PATH=f"{find_pytriton() / 'bin'}{os.pathsep}{env['PATH']}",
        PAGEDLLM_MODEL_DIR=str(slow_checkpoint),
        PAGEDLLM_DTYPE="float32",
        PAGEDLLM_DRAIN_TIMEOUT_S=str(DRAIN),
        PAGEDLLM_DRAIN_FILE=str(tmp_path / "drain"),
        PAGEDLLM_METRICS_URL=server.metrics_url,
    )
    script = Path(__file__).resolve().parents[1] / "docker" / "serve.sh"
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([str(script), *argv[1:]], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while not server.is_ready():
            assert proc.poll() is None and time.monotonic() < deadline, "no start"
            time.sleep(0.2)
        long = GrpcStream(server, {**long_request(), "stream": True})
        wait_running(server, 1)
        proc.send_signal(signal.SIGTERM)  # what docker stop / Kubernetes send
        assert long.done.wait(DRAIN + 5), "the request was not ended by the drain"
        long.client.stop_stream()
        assert long.error is None and long.responses[-1][1]["finish_reason"] == "abort"
        assert proc.wait(30) == 0
        assert not (tmp_path / "drain").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(backend)], check=False)
