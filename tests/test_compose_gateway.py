"""docker-compose.yml's `openai` service, the OpenAI gateway in front of the tritonserver
service (what `pagedllm serve` runs on one machine), checked statically like the rest of the
deployment (tests/test_docker.py): its command parsed by the real CLI."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from docker_files import (
    COMPOSE_FILE,
    DEPLOYMENT_DOC,
    compose_default,
    parse_duration,
    port_pairs,
    url_port,
)

from pagedllm import cli

Yaml = dict[str, Any]


@pytest.fixture(scope="module")
def services() -> Yaml:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert set(data["services"]) == {"tritonserver", "openai"}, sorted(data["services"])
    return dict(data["services"])


def test_compose_gateway_serves_chat_in_front_of_tritonserver(
    services: Yaml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The openai service: the same image running `pagedllm openai` (parsed by the real CLI)
    against the tritonserver service's gRPC and metrics ports, for the model tritonserver serves,
    published, started once tritonserver is healthy, healthy itself on /health."""
    service, gateway = services["tritonserver"], services["openai"]
    seen: list[Any] = []
    monkeypatch.setattr("pagedllm.openai.app.serve", lambda *a: seen.append(a) or 0)
    argv = [compose_default(word) for word in gateway["command"]]
    assert argv[:2] == ["pagedllm", "openai"]
    monkeypatch.delenv("PAGEDLLM_TRUST_REQUEST_CHAT_TEMPLATE", raising=False)
    for name, value in gateway["environment"].items():
        monkeypatch.setenv(name, compose_default(value))
    assert cli.main(argv[1:]) == 0
    (config, host, port), triton = seen[0], port_pairs(service)
    assert config.triton_url == "tritonserver:8001" and 8001 in triton
    assert config.metrics_url == "http://tritonserver:8002/metrics" and 8002 in triton
    assert config.model_dir == compose_default(service["environment"]["PAGEDLLM_MODEL_DIR"])
    assert not config.trust_request_chat_template  # off unless asked
    assert host == "0.0.0.0" and port_pairs(gateway) == {port: port}
    assert gateway["image"] == service["image"] and "build" not in gateway
    assert gateway["depends_on"] == {"tritonserver": {"condition": "service_healthy"}}
    health = gateway["healthcheck"]
    assert url_port(" ".join(health["test"])) == (port, "/health")
    assert parse_duration(health["timeout"]) < parse_duration(health["interval"])
    models = [v for v in gateway["volumes"] if v["target"] == "/models"]  # its tokenizer
    assert models == [v for v in service["volumes"] if isinstance(v, dict)]
    doc = DEPLOYMENT_DOC.read_text(encoding="utf-8")  # the chat query and the variable
    assert f"localhost:{port}/v1/chat/completions" in doc
    assert all(name in doc for name in gateway["environment"])
