"""The engine's vllm:* metrics on a running tritonserver's metrics port, for tests that check
that requests (finished, failed or cancelled) leave no KV block behind."""

from __future__ import annotations

import time
import urllib.error

from pagedllm.serving.metrics import scrape as metrics


def is_idle(m: dict[str, float]) -> bool:
    return (
        m.get("vllm:num_requests_running") == 0
        and m.get("vllm:num_requests_waiting") == 0
        and m.get("vllm:kv_cache_usage_perc") == 0
    )


def wait_idle(metrics_url: str, timeout: float) -> float:
    """Seconds until no request runs or waits and no KV block is in use (AssertionError with
    the metrics after `timeout`)."""
    start = time.monotonic()
    while True:
        m = metrics(metrics_url)
        elapsed = time.monotonic() - start
        if is_idle(m) or elapsed > timeout:
            assert is_idle(m), m
            return elapsed
        time.sleep(0.02)


def wait_running(metrics_url: str, n: int, timeout: float) -> None:
    """Until `n` requests run. The gauges are published on their own thread and may trail the
    responses: a test that cancels a request and then waits for idle gauges must first see
    them busy, or it may read the idle ones of before the request (nothing counted yet)."""
    deadline = time.monotonic() + timeout
    while (m := _metrics_once_up(metrics_url, deadline)).get("vllm:num_requests_running") != n:
        assert time.monotonic() < deadline, (f"{n} requests never ran", m)
        time.sleep(0.02)


def _metrics_once_up(metrics_url: str, deadline: float) -> dict[str, float]:
    """The metrics; a refused connection is retried until `deadline`: tritonserver reports
    ready on its HTTP port before its metrics port listens (seen in CI: ready, a request
    streaming, and the metrics port still refusing)."""
    while True:
        try:
            return metrics(metrics_url)
        except urllib.error.URLError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
