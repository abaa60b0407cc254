"""One soak from start to rest: the tiny model and the gateway subprocess (set-up), then
tritonserver, the oracle, a warm-up, the load with its samples, and the engine back at rest."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.serving.launcher import make_server
from pagedllm.serving.tritonserver import TritonServer, free_port
from pagedllm.text.tokenizer import Tokenizer

from .load import Soak
from .plans import Spec, make_specs
from .resources import snapshot, stubs

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests"))
import server_metrics  # noqa: E402  (tests/server_metrics.py)

# a ChatML-like template for --tiny (test_openai's): the tiny tokenizer has no template
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s>' + message['role'] + '\\n' + message['content'] + "
    "'</s>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def tiny_model(root: Path) -> Path:
    from conftest import make_checkpoint  # tests/conftest.py

    path = make_checkpoint(root / "tiny-llama", "llama")
    config = {"chat_template": TINY_CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@contextlib.contextmanager
def run_gateway(server: TritonServer, model_dir: Path, log_path: Path) -> Iterator[tuple[int, int]]:
    """`pagedllm openai` as a subprocess; (port, pid) once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "openai", "--triton-url", server.grpc_url]
    cmd += ["--port", str(port), "--model-dir", str(model_dir)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        yield port, proc.pid
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        proc.kill()


@dataclass
class Observed:
    """What a soak saw besides its requests."""

    specs: list[Spec]
    oracle_s: float
    load_s: float
    samples: list[dict[str, Any]]  # snapshot()s: at the start, every --sample-every s, the end
    before: dict[str, float]  # the engine's metrics when the load began
    after: dict[str, float]  # and once at rest (or after --idle-timeout)
    idle_s: float | None  # seconds to rest after the load; None: not within --idle-timeout
    stub_pids: tuple[dict[str, int], dict[str, int]]  # at the start and the end
    server_alive: bool  # the same tritonserver process ran throughout
    server_log: Path


def soak(args: argparse.Namespace, model_dir: Path, work: Path) -> tuple[Soak, Observed]:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    context = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    specs = make_specs(tokenizer, context, args.prompts, random.Random(args.seed))
    server = make_server(str(model_dir), dtype=args.dtype)
    log(f"starting tritonserver ({model_dir.name}, {args.dtype}); log {server.log_path}")
    with server, run_gateway(server, model_dir, work / "gateway.log") as (gateway_port, gw_pid):
        assert server.process is not None
        pid = server.process.pid
        state = Soak(server, gateway_port, model_dir.name, args.request_timeout)
        state.oracle.check_text = args.dtype == "float32"
        log(f"oracle: {len(specs)} prompts x 3 protocol families")
        t = time.monotonic()
        state.make_oracle(specs)
        oracle_s = time.monotonic() - t
        state.warm_up(specs[0])
        server_metrics.wait_idle(server.metrics_url, timeout=60)
        before = server_metrics.metrics(server.metrics_url)
        stubs_before = stubs(pid)
        t0 = time.monotonic()
        samples = [snapshot(pid, gw_pid, 0, t0)]
        _load(args, state, specs, samples, gw_pid, t0)
        load_s = time.monotonic() - t0
        idle_s: float | None = None
        after: dict[str, float] = {}
        with contextlib.suppress(AssertionError, OSError):  # busy, or the server is gone
            idle_s = server_metrics.wait_idle(server.metrics_url, args.idle_timeout)
        with contextlib.suppress(OSError):
            after = server_metrics.metrics(server.metrics_url)
        time.sleep(1.0)  # connections the clients closed last are closed on the server too
        samples.append(snapshot(pid, gw_pid, len(state.records), t0))
        alive = server.process.poll() is None
        observed = Observed(
            specs,
            oracle_s,
            load_s,
            samples,
            before,
            after,
            idle_s,
            (stubs_before, stubs(pid)),
            alive,
            server.log_path,
        )
    return state, observed


def _load(
    args: argparse.Namespace,
    state: Soak,
    specs: list[Spec],
    samples: list[dict[str, Any]],
    gw_pid: int,
    t0: float,
) -> None:
    """--concurrency workers for --minutes (or until tritonserver exits), a snapshot appended
    to `samples` every --sample-every s; then the workers stopped, those stuck recorded."""
    process = state.server.process
    assert process is not None
    log(f"load: {args.minutes} min, {args.concurrency} clients")
    stop = threading.Event()
    workers = [
        threading.Thread(target=state.worker, args=(args.seed * 1000 + i, specs, stop), daemon=True)
        for i in range(args.concurrency)
    ]
    for w in workers:
        w.start()
    end = t0 + args.minutes * 60
    while (now := time.monotonic()) < end and process.poll() is None:
        time.sleep(min(args.sample_every, end - now))
        samples.append(snapshot(process.pid, gw_pid, len(state.records), t0))
        rss = samples[-1]["procs"]["server_and_stubs"]["rss_mib"]
        log(f"{samples[-1]['t_s']:.0f} s, {rss} MiB: {dict(state.outcomes())}")
    stop.set()
    deadline = time.monotonic() + args.request_timeout + 30
    for w in workers:
        w.join(max(deadline - time.monotonic(), 0))
    state.records += state.stuck(args.request_timeout)  # their threads are left behind
