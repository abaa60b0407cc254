"""Tensor parallelism under a real tritonserver (tiny llama, 2 ranks on the CPU), one server
for the module: the text streams exactly as one rank's offline engine writes it; unloading
and reloading the engine three times leaves no worker process behind (by pid); a worker
killed mid-stream fails the request with the worker's reason, and the server turns unready
and shuts down, exiting 0 within its timeout with every worker gone."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_drain import repository
from test_server import GrpcStream, offline_text
from test_tensor_parallel import SPAWN, alive, wait_gone

from pagedllm import LLM
from pagedllm.serving.tritonserver import TritonServer

EXIT_TIMEOUT = 30  # Triton's --exit-timeout-secs


def make(ckpt: Path, work: Path, *extra_args: str) -> TritonServer:
    from pagedllm.serving.launcher import make_server

    env = {"PAGEDLLM_TENSOR_PARALLEL_SIZE": "2", "PAGEDLLM_DRAIN_TIMEOUT_S": "2"}
    server = make_server(str(ckpt), dtype="float32", work_dir=work, env=env)
    server.extra_args = list(extra_args)
    server.exit_timeout = EXIT_TIMEOUT
    return server


def workers(server: TritonServer) -> list[int]:
    """The server's descendants that are spawned workers (llm_engine's ranks 1..N-1)."""
    assert server.process is not None
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, found = {server.process.pid}, True
    while found:
        found = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                found = True
    out = []
    for pid in tree:
        try:
            if SPAWN in Path(f"/proc/{pid}/cmdline").read_text():
                out.append(pid)
        except OSError:
            pass
    return sorted(out)


def stream(max_tokens: int) -> dict[str, object]:
    return {"text_input": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    work = tmp_path_factory.mktemp("tp-triton")
    s = make(checkpoints["llama"], work, "--model-control-mode=explicit", "--load-model=*")
    with s:
        yield s


def test_two_ranks_stream_the_offline_text(server: TritonServer, llm: LLM) -> None:
    assert len(workers(server)) == 1
    s = GrpcStream(server, {**stream(24), "temperature": 0.0})
    text = s.wait()
    assert text == offline_text(llm, max_tokens=24)


def test_unload_and_reload_three_times_leaves_no_worker(server: TritonServer, llm: LLM) -> None:
    expected = offline_text(llm, max_tokens=8)
    seen: list[int] = []
    for _ in range(3):
        [pid] = workers(server)
        seen.append(pid)
        assert repository(server, "unload") == 200
        assert not wait_gone([pid], 15), f"worker {pid} outlived the unload"
        assert repository(server, "load") == 200
        assert GrpcStream(server, {**stream(8), "temperature": 0.0}).wait() == expected
    assert len(set(seen)) == 3 and not any(alive(p) for p in seen)


def test_a_killed_worker_fails_the_stream_and_the_server_exits_0(server: TritonServer) -> None:
    """The last test of the module: it ends the server. The dead worker kills the engine,
    which stops the server (exit_on_engine_failure): its shutdown unloads the models and
    exits 0 within the exit timeout (the same finalize as the unloads above, with a dead
    rank), leaving no worker."""
    pids = workers(server)
    [pid] = pids
    long = GrpcStream(server, {**stream(480), "temperature": 0.0})
    while not long.responses:  # it is streaming
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    assert long.done.wait(30), "the stream hangs"
    long.client.stop_stream()
    assert "the engine is dead" in str(long.error)
    assert f"tensor-parallel worker 1 (pid {pid}) died" in str(long.error)
    assert server.process is not None
    start = time.monotonic()
    assert server.process.wait(EXIT_TIMEOUT + 10) == 0  # unready, then it exits by itself
    assert time.monotonic() - start < EXIT_TIMEOUT
    assert not server.is_ready()
    assert not wait_gone(pids, 5)
    assert "stopping tritonserver" in server.log_path.read_text()
