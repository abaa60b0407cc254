"""`pagedllm openai` as a subprocess for the gateway tests: started on a free port in front of
a running tritonserver, waited for until `/health` answers, stopped on exit; and the tiny
llama checkpoint's chat template the gateway tests serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pagedllm.serving.tritonserver import TritonServer, free_port

MODEL = "tiny-llama"
PROMPT = "Once upon a time"
# a ChatML-like template over the tiny tokenizer's special tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s>' + message['role'] + '\\n' + message['content'] + "
    "'</s>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)


def with_chat_template(path: Path) -> Path:
    """The checkpoint at `path`, its tokenizer_config.json given CHAT_TEMPLATE."""
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@contextmanager
def running_gateway(
    server: TritonServer,
    model_dir: Path,
    log: Path,
    *args: str,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """The gateway's base URL (http://127.0.0.1:PORT); `args`: more command-line options;
    `env`: more environment variables; its output goes to `log` (shown if it stops or does not
    answer within 60 s)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "openai", "--triton-url", server.grpc_url]
    cmd += ["--port", str(port), "--model-dir", str(model_dir), "--metrics-url", server.metrics_url]
    cmd += list(args)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
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


@contextmanager
def warm_gateway(server: TritonServer, model_dir: Path, log: Path) -> Iterator[str]:
    """running_gateway, after one streamed request through it (the first request through a
    fresh server is slow: lazy set-up along the pipeline)."""
    with running_gateway(server, model_dir, log) as url:
        warm_up = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True}
        assert httpx.post(f"{url}/v1/completions", json=warm_up, timeout=60).status_code == 200
        yield url
