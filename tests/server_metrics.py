"""The engine's vllm:* metrics on a running tritonserver's metrics port, for tests that check
that requests (finished, failed or cancelled) leave no KV block behind."""

from __future__ import annotations

import re
import time
import urllib.request


def metrics(metrics_url: str) -> dict[str, float]:
    """The vllm:* (and pagedllm:*) samples of Triton's metrics endpoint, keyed by name{labels} without the
    model and version labels, e.g. `vllm:request_success_total{finished_reason=abort}`."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        m = re.match(r"((?:vllm|pagedllm):\w+)\{([^}]*)\} (\S+)", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            extra = ",".join(f"{k}={v}" for k, v in labels.items() if k not in ("model", "version"))
            samples[m.group(1) + (f"{{{extra}}}" if extra else "")] = float(m.group(3))
    return samples


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
