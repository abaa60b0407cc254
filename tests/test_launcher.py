"""Several tritonservers on one machine: each writes a log of its own, and a start-up fails or
succeeds on its own account (its exit, its own readiness on its own ports), never because of
another server's log or ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedllm.cli import main
from pagedllm.serving import pytriton_wheel, tritonserver
from pagedllm.serving.launcher import make_server, new_log_file
from pagedllm.serving.tritonserver import CPU_QUIET_ARGS, TritonServer, free_port


def generate(server: TritonServer) -> str:
    body = {"text_input": "Once upon a time", "max_tokens": 4, "temperature": 0}
    url = f"{server.http_url}/v2/models/ensemble/generate"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return str(json.load(resp)["text_output"])


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def pair(checkpoints: dict[str, Path], home: Path) -> Iterator[list[TritonServer]]:
    """Two servers with default work directory, log files and ports (the default work directory
    under a temporary HOME), started at the same time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))  # only while making them: the stubs keep the real HOME
        servers = [make_server(str(checkpoints["llama"]), dtype="float32") for _ in range(2)]
    # The servers get SIGTERM when the thread that started them ends: the pool's threads live
    # until the servers are stopped.
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        try:
            errors = [f.exception() for f in futures]
            if any(errors):
                raise RuntimeError(f"start-up failed: {errors}")
            yield servers
        finally:
            for s in servers:
                s.stop()


def test_two_servers_at_once_each_with_its_own_log(pair: list[TritonServer], home: Path) -> None:
    a, b = pair
    assert a.log_path != b.log_path
    logs = home / ".cache" / "pagedllm" / "triton" / "logs"
    assert {a.log_path.parent, b.log_path.parent} == {logs}
    assert {a.http_port, a.grpc_port, a.metrics_port}.isdisjoint(
        {b.http_port, b.grpc_port, b.metrics_port}
    )
    for me, other in (a, b), (b, a):
        assert me.is_ready()
        log = me.log_path.read_text()
        assert f"Started HTTPService at 127.0.0.1:{me.http_port}" in log
        assert f"127.0.0.1:{other.http_port}" not in log
        assert "already in use" not in log
        assert generate(me)


def test_ports_in_use_fail_clearly_and_the_first_server_keeps_serving(
    pair: list[TritonServer], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    a = pair[0]
    before = a.log_path.read_bytes()
    c = make_server(
        str(checkpoints["llama"]),
        dtype="float32",
        work_dir=tmp_path,
        ports=(a.http_port, a.grpc_port, a.metrics_port),
    )
    with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{a.http_port} \(HTTP\).*already in use"):
        c.start()
    assert c.process is None
    assert f"pagedllm: 127.0.0.1:{a.http_port} (HTTP)" in c.log_path.read_text()
    assert a.is_ready() and generate(a)
    after = a.log_path.read_bytes()
    assert after.startswith(before) and b"already in use" not in after


@pytest.mark.parametrize("taken", ["http", "grpc", "metrics"])
def test_a_port_taken_after_the_check_fails_the_start(
    pair: list[TritonServer], taken: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the pre-start port check cannot see: Triton itself finds a port taken (by the
    first server). With the metrics port, the new server's own HTTP endpoint answers ready for
    a moment before it exits; with the HTTP port, the first server answers."""
    a = pair[0]
    real, checks = tritonserver.port_is_free, []

    def port_is_free(port: int) -> bool:
        checks.append(port)
        return len(checks) <= 3 or real(port)  # the three checks before the launch pass

    monkeypatch.setattr(tritonserver, "port_is_free", port_is_free)
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    ports[taken] = getattr(a, f"{taken}_port")
    (tmp_path / "repo").mkdir()
    empty = TritonServer(  # no models: up or down within a second
        [tmp_path / "repo"],
        pytriton_wheel.prepare_backend_dir(tmp_path / "backends"),
        log_path=tmp_path / "tritonserver.log",
        ports=(ports["http"], ports["grpc"], ports["metrics"]),
        extra_args=CPU_QUIET_ARGS,
        start_timeout=60,
    )
    with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{ports[taken]} .*already in use"):
        empty.start()
    assert len(checks) == 6  # the launch happened
    assert "failed to start" in empty.log_path.read_text()
    assert a.is_ready() and "already in use" not in a.log_path.read_text()


def test_serve_log_file_is_appended_and_printed(
    pair: list[TritonServer],
    checkpoints: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`pagedllm serve --log-file` on a taken port: a clear error, nothing started, and the
    log (named in the output) keeps what it had."""
    a, log = pair[0], tmp_path / "serve.log"
    log.write_text("an earlier run\n")
    argv = ["serve", "--model", str(checkpoints["llama"]), "--dtype", "float32"]
    argv += ["--log-file", str(log), "--http-port", str(a.http_port)]
    argv += ["--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--no-openai"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert f"log: {log}" in out
    assert f"127.0.0.1:{a.http_port} (HTTP) already in use" in err
    text = log.read_text()
    assert text.startswith("an earlier run\n")
    assert f"pagedllm: 127.0.0.1:{a.http_port} (HTTP) already in use" in text
    assert a.is_ready()


def test_new_log_files_are_unique_and_old_ones_do_not_pile_up(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead, live = int(child.stdout), os.getpid()
    old = {
        (i, pid): tmp_path / f"tritonserver-2000010{i}-000000-pid{pid}-x.log"
        for i in range(1, 7)  # oldest first
        for pid in (dead, live)
    }
    for path in old.values():
        path.touch()
    made = [new_log_file(tmp_path, keep=100) for _ in range(3)]
    assert len(set(made)) == 3 and all(p.parent == tmp_path and p.exists() for p in made)
    assert all(p.exists() for p in old.values())
    newest = new_log_file(tmp_path, keep=7)  # 7 of the 15 others: 3 made, days 5 and 6
    gone = {old[i, dead] for i in range(1, 5)}  # the others of the dead process
    assert {*tmp_path.iterdir()} == {*old.values(), *made, newest} - gone
