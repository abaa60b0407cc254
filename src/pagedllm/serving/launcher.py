"""`pagedllm serve`: the model repository on the real tritonserver of the nvidia-pytriton
wheel, on this machine (CPU), until Ctrl-C."""

from __future__ import annotations

import signal
import site
import sys
import threading
from pathlib import Path

from pagedllm.serving.tritonserver import TritonServer, prepare_backend_dir

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
ENSEMBLE_CONFIG = REPO_ROOT / "ensemble_config"
# numpy 1.x for the stub (its bindings break on numpy 2), installed by scripts/setup.sh
STUB_SITE = Path(sys.prefix) / "stub-site"


def stub_sys_path() -> list[str]:
    if not (STUB_SITE / "numpy").is_dir():
        raise RuntimeError(
            f"missing {STUB_SITE} (numpy<2 for the Triton stub): run `bash scripts/setup.sh`"
        )
    return [str(STUB_SITE), *site.getsitepackages()]


def make_server(
    model_dir: str,
    *,
    ports: tuple[int, int, int] | None = None,
    dtype: str = "auto",
    work_dir: Path | None = None,
    log_verbose: int = 0,
    env: dict[str, str] | None = None,
) -> TritonServer:
    """`env`: more settings for the models, e.g. PAGEDLLM_TRACE_FILE (docs/serving.md)."""
    work = work_dir or Path.home() / ".cache" / "pagedllm" / "triton"
    backend = prepare_backend_dir(work / "backends", f"{sys.version_info[0]}.{sys.version_info[1]}")
    return TritonServer(
        [MODEL_REPOSITORY, ENSEMBLE_CONFIG],
        backend,
        extra_pythonpath=stub_sys_path(),
        log_path=work / "tritonserver.log",
        log_verbose=log_verbose,
        ports=ports,
        env={"PAGEDLLM_MODEL_DIR": model_dir, "PAGEDLLM_DTYPE": dtype, **(env or {})},
        start_timeout=600.0,
    )


def serve(
    model_dir: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    dtype: str,
    env: dict[str, str] | None = None,
) -> int:
    server = make_server(
        model_dir, ports=(http_port, grpc_port, metrics_port), dtype=dtype, env=env
    )
    print(f"starting tritonserver with {model_dir} (log: {server.log_path}) ...", flush=True)
    with server:
        print(
            f"ready:\n  HTTP    {server.http_url}\n  gRPC    {server.grpc_url}\n"
            f"  metrics {server.metrics_url}\n\ntry:\n"
            f"  curl -sN {server.http_url}/v2/models/ensemble/generate_stream -d "
            """'{"text_input": "Once upon a time,", "max_tokens": 32, "stream": true}'\n"""
            f"  curl -s {server.http_url}/v2/models/ensemble/generate -d "
            """'{"text_input": "Once upon a time,", "max_tokens": 32, "temperature": 0}'\n"""
            f"  python -m client.stream --url {server.grpc_url} 'Once upon a time,'\n"
            "\nCtrl-C stops it.",
            flush=True,
        )
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while not stop.wait(1.0):
            if server.process is not None and server.process.poll() is not None:
                print("tritonserver exited; see the log", file=sys.stderr)
                return 1
    print("stopped")
    return 0
