"""`pagedllm openai` as a subprocess for the gateway tests: started on a free port in front of
a running tritonserver, waited for until `/health` answers, stopped on exit."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pagedllm.serving.tritonserver import TritonServer, free_port


@contextmanager
def running_gateway(server: TritonServer, model_dir: Path, log: Path, *args: str) -> Iterator[str]:
    """The gateway's base URL (http://127.0.0.1:PORT); `args`: more command-line options; its
    output goes to `log` (shown if it stops or does not answer within 60 s)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "openai", "--triton-url", server.grpc_url]
    cmd += ["--port", str(port), "--model-dir", str(model_dir), "--metrics-url", server.metrics_url]
    cmd += list(args)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
