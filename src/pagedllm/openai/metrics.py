"""`GET /metrics` of the gateway: tritonserver's Prometheus metrics, relayed as they are.

The Gateway API Inference Extension's endpoint picker (llm-d's too) scrapes each pod of an
InferencePool at the pool's target port, path `/metrics` (its `--model-server-metrics-path`
default): the port it routes OpenAI requests to, this gateway's. What it reads —
`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:cache_config_info` — the engine exports on Triton's metrics port (8002 in the image).
"""

from __future__ import annotations

import asyncio
import urllib.request

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.openai.errors import APIError

# tritonserver's --metrics-port in the image and under `pagedllm serve`'s defaults
TRITON_METRICS_PORT = 8002
# Prometheus' text exposition format, what Triton answers
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


def default_metrics_url(triton_url: str) -> str:
    """Triton's metrics endpoint next to its gRPC endpoint `host:port`: same host, port 8002."""
    host = triton_url.rsplit(":", 1)[0] if ":" in triton_url else triton_url
    return f"http://{host or 'localhost'}:{TRITON_METRICS_PORT}/metrics"


class MetricsRelay:
    """The `/metrics` route: one GET of Triton's endpoint per scrape (nothing cached, so a
    scraper sees the gauges as they are), 503 when it cannot be read."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url
        self.timeout = timeout

    def _get(self) -> bytes:
        with urllib.request.urlopen(self.url, timeout=self.timeout) as r:
            body: bytes = r.read()
            return body

    async def metrics(self, request: Request) -> Response:
        try:  # urllib blocks: off the event loop, which keeps serving the streams
            body = await asyncio.to_thread(self._get)
        except OSError as e:  # refused, timed out, or an HTTP error status (HTTPError)
            raise APIError(503, f"Triton's metrics at {self.url} cannot be read: {e}") from None
        return Response(body, media_type=TEXT_FORMAT)
