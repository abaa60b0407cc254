"""The gateway's `/metrics` relay (`pagedllm.openai.metrics`) against a real HTTP server
standing in for Triton's metrics port, and against nothing: what it relays, and the 503. The
relay on a real tritonserver: tests/gateway_metrics.py (run by test_openai)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from pagedllm.openai.app import _api_error_response
from pagedllm.openai.errors import APIError
from pagedllm.openai.metrics import MetricsRelay, default_metrics_url
from pagedllm.serving.tritonserver import free_port

EXPOSITION = (
    "# HELP vllm:num_requests_waiting Requests waiting to be scheduled.\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{model="llm_engine",version="1"} 3\n'
)


class _Exposition(BaseHTTPRequestHandler):
    scrapes = 0

    def do_GET(self) -> None:
        type(self).scrapes += 1
        body = f"{EXPOSITION}scrape_number {type(self).scrapes}\n".encode()
        status = 200 if self.path == "/metrics" else 404
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def exposition() -> Iterator[str]:
    """A real HTTP server on a free port answering GET /metrics; its base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Exposition)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def client(url: str) -> TestClient:
    app = Starlette(
        routes=[Route("/metrics", MetricsRelay(url, timeout=2).metrics)],
        exception_handlers={APIError: _api_error_response},
    )
    return TestClient(app)


def test_relays_every_scrape_as_it_is(exposition: str) -> None:
    with client(f"{exposition}/metrics") as c:
        first, second = c.get("/metrics"), c.get("/metrics")
    assert first.status_code == second.status_code == 200
    assert first.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert first.text.startswith(EXPOSITION) and second.text.startswith(EXPOSITION)
    # nothing cached: each scrape reads the gauges anew
    n = int(first.text.split()[-1])
    assert int(second.text.split()[-1]) == n + 1


def test_unreadable_metrics_answer_503(exposition: str) -> None:
    with client(f"http://127.0.0.1:{free_port()}/metrics") as c:
        refused = c.get("/metrics")
    with client(f"{exposition}/no-such-path") as c:
        missing = c.get("/metrics")
    for r in (refused, missing):
        assert r.status_code == 503
        assert "cannot be read" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("triton_url", "expected"),
    [
        ("localhost:8001", "http://localhost:8002/metrics"),
        ("10.0.0.7:31001", "http://10.0.0.7:8002/metrics"),
        ("[::1]:8001", "http://[::1]:8002/metrics"),
        ("triton", "http://triton:8002/metrics"),
    ],
)
def test_default_metrics_url_is_tritons_metrics_port(triton_url: str, expected: str) -> None:
    assert default_metrics_url(triton_url) == expected
