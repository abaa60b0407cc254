"""The Helm chart (deploy/helm/pagedllm) without a cluster: `helm lint --strict` and the
rendering by Helm's Go code (helm-python-sdk), every manifest of several value sets valid
against the Kubernetes schemas and the CRDs' (tests/k8s_files.py), and the chart checked
against what the image and docker-compose.yml do: the same command, ports, environment
variables, /dev/shm, kernel caches, health checks and stop timing; metric names the engine
really exports; the selectors select the pods."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_files import (
    COMPOSE_FILE,
    ENGINE_CONFIG_PBTXT,
    MIN_START_PERIOD_S,
    READY_PATH,
    ROOT,
    Dockerfile,
    compose_default,
    device_on_a_gpu_host,
    engine_pbtxt,
    parse_bytes,
    parse_dockerfile,
    parse_duration,
    run_engine_config,
    source_env_names,
)
from k8s_files import (
    CHART,
    Doc,
    container,
    env_of,
    flags,
    lint,
    pod_spec,
    pre_stop_seconds,
    render,
    schema_errors,
    serve_sh_default,
    stop_budget,
)

from pagedllm import cli
from pagedllm.serving.metrics import GAUGES

EVERYTHING: Doc = {
    "monitoring": {"podMonitor": {"enabled": True}},
    "autoscaling": {"keda": {"enabled": True}},
    "inferencePool": {"enabled": True},
    "models": {"volume": {"persistentVolumeClaim": {"claimName": "hf-models"}}},
    "env": {"PAGEDLLM_MODEL_DIR": "/models/Qwen2.5-0.5B-Instruct", "PAGEDLLM_DTYPE": "bfloat16"},
    "gateway": {"servedModelName": "qwen", "trustRequestChatTemplate": True},
}
VALUE_SETS: dict[str, Doc] = {
    "defaults": {},
    "everything": EVERYTHING,
    "servicemonitor-hpa": {
        "monitoring": {"serviceMonitor": {"enabled": True}},
        "autoscaling": {"hpa": {"enabled": True}},
    },
    "no-gateway": {"gateway": {"enabled": False}, "podDisruptionBudget": {"enabled": False}},
}


@pytest.fixture(scope="module")
def defaults() -> Doc:
    return render()


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile(parse_dockerfile((ROOT / "docker/Dockerfile").read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def compose_service() -> Doc:
    return dict(
        yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))["services"]["tritonserver"]
    )


# ---- helm lint, schemas


def test_helm_lint_finds_nothing_and_rejects_a_broken_chart(tmp_path: Path) -> None:
    assert lint(CHART) == []
    broken = tmp_path / "pagedllm"
    shutil.copytree(CHART, broken)
    service = broken / "templates" / "service.yaml"
    service.write_text(service.read_text().replace("{{- end }}", "", 1))
    assert lint(broken), "helm lint accepts a template with an unclosed block"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_manifest_matches_its_schema(name: str) -> None:
    docs = render(VALUE_SETS[name])
    for doc in docs.values():
        assert schema_errors(doc) == [], doc["kind"]


def test_schemas_reject_what_the_api_server_would() -> None:
    """Each schema source sees a misplaced field (strict) and a wrong type."""
    docs = {**render(VALUE_SETS["servicemonitor-hpa"]), **render(EVERYTHING)}
    assert len(docs) == 8
    for kind, doc in docs.items():
        doc = yaml.safe_load(yaml.safe_dump(doc))
        doc["spec"]["replicaz"] = 2
        assert schema_errors(doc), f"{kind}: an unknown spec field passes"
        assert schema_errors({**doc, "spec": "nothing"}), f"{kind}: a string spec passes"
    pool = docs["InferencePool"]
    pool["spec"]["targetPorts"] = [{"number": "9000"}]
    assert schema_errors(pool)


# ---- the tritonserver container runs what the image runs


def test_tritonserver_runs_the_image_command(defaults: Doc, dockerfile: Dockerfile) -> None:
    triton = container(defaults, "tritonserver")
    assert "command" not in triton, "the image's ENTRYPOINT (NGC's) must stay"
    assert triton["args"] == dockerfile.command()
    assert triton["image"] == "pagedllm:latest"
    exposed = {int(p) for i in dockerfile.of("EXPOSE") for p in i.args.split()}
    ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    assert set(ports.values()) == exposed
    args = flags(triton["args"])
    for kind in ("http", "grpc", "metrics"):
        assert args[f"{kind}-port"] == [str(ports[kind])]


def test_probes_hit_tritons_health_endpoints_sized_for_a_cold_start(
    defaults: Doc, compose_service: Doc
) -> None:
    triton = container(defaults, "tritonserver")
    http = {p["name"]: p["containerPort"] for p in triton["ports"]}["http"]
    assert flags(triton["args"])["http-port"] == [str(http)]
    probes = {k: triton[f"{k}Probe"] for k in ("startup", "readiness", "liveness")}
    for kind, probe in probes.items():
        assert probe["httpGet"]["port"] == "http", kind
        assert probe["timeoutSeconds"] < probe["periodSeconds"], kind
    assert probes["startup"]["httpGet"]["path"] == READY_PATH
    assert probes["readiness"]["httpGet"]["path"] == READY_PATH
    assert probes["liveness"]["httpGet"]["path"] == "/v2/health/live"
    startup = probes["startup"]["periodSeconds"] * probes["startup"]["failureThreshold"]
    compose_start = parse_duration(compose_service["healthcheck"]["start_period"])
    assert startup >= max(MIN_START_PERIOD_S, compose_start)


@pytest.mark.parametrize("name", ["defaults", "everything"])
def test_grace_period_outlasts_the_drain(name: str, compose_service: Doc) -> None:
    docs = render(VALUE_SETS[name])
    grace = pod_spec(docs)["terminationGracePeriodSeconds"]
    for c in pod_spec(docs)["containers"]:
        budget = stop_budget(env_of(c), c.get("args", []), pre_stop_seconds(c))
        assert grace > budget, f"{c['name']}: {grace} s <= {budget} s"
    # the engine's own drain (config.pbtxt drain_timeout_s) ends within serve.sh's wait
    triton = container(docs, "tritonserver")
    _, params = engine_pbtxt()
    drain_wait = env_of(triton).get("PAGEDLLM_DRAIN_WAIT_S") or serve_sh_default(
        "PAGEDLLM_DRAIN_WAIT_S"
    )
    assert float(params["drain_timeout_s"]) < float(drain_wait)
    assert grace >= parse_duration(compose_service["stop_grace_period"])


# ---- environment, resources, volumes


def test_env_is_composes_and_pagedllm_reads_it(defaults: Doc, compose_service: Doc) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    engine, _ = run_engine_config({"PAGEDLLM_MODEL_DIR": "/model"}, {})
    assert set(values["env"]) == set(compose_service["environment"])
    assert set(values["env"]) <= engine | source_env_names()
    for name, value in values["env"].items():  # the same defaults as compose
        assert str(value) == compose_default(compose_service["environment"][name]), name
    rendered = env_of(container(defaults, "tritonserver"))
    assert rendered == {k: str(v) for k, v in values["env"].items() if v != ""}
    # on a GPU node the engine takes the pod's GPU
    assert device_on_a_gpu_host(rendered)[1] == "cuda:0"
    assert env_of(container(render(EVERYTHING), "tritonserver"))["PAGEDLLM_DTYPE"] == "bfloat16"
    assert ENGINE_CONFIG_PBTXT.is_file()


def test_gpu_shm_and_kernel_caches(
    defaults: Doc, compose_service: Doc, dockerfile: Dockerfile
) -> None:
    triton = container(defaults, "tritonserver")
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in pod_spec(defaults)["volumes"]}
    mounts = {m["mountPath"]: m for m in triton["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    shm_bytes = parse_bytes(shm["sizeLimit"].replace("Gi", "g").replace("Mi", "m"))
    assert shm_bytes >= parse_bytes(compose_service["shm_size"])
    memory = parse_bytes(triton["resources"]["limits"]["memory"].replace("Gi", "g"))
    assert memory > shm_bytes  # /dev/shm counts against the container's memory
    for variable in ("TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        assert dockerfile.env()[variable] in mounts, variable


def test_models_volume_is_read_only_in_both_containers() -> None:
    docs = render(EVERYTHING)
    assert {v["name"] for v in pod_spec(docs)["volumes"]} >= {"models"}
    model_dir = env_of(container(docs, "tritonserver"))["PAGEDLLM_MODEL_DIR"]
    for name in ("tritonserver", "openai"):
        (mount,) = [m for m in container(docs, name)["volumeMounts"] if m["name"] == "models"]
        assert mount["readOnly"] is True and model_dir.startswith(mount["mountPath"] + "/")
    assert "models" not in {v["name"] for v in pod_spec(render())["volumes"]}


# ---- the OpenAI gateway sidecar


def gateway_config(c: Doc, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The GatewayConfig `pagedllm openai` builds from the sidecar's arguments (the real CLI
    parser; the server start replaced by a recorder)."""
    seen: dict[str, Any] = {}

    def serve(config: Any, host: str, port: int) -> int:
        seen.update(config=config, host=host, port=port)
        return 0

    monkeypatch.setattr("pagedllm.openai.app.serve", serve)
    assert c["command"][0] == "pagedllm"
    assert cli.main([*c["command"][1:], *c["args"]]) == 0
    return seen


def test_gateway_sidecar_talks_to_the_local_tritonserver(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(EVERYTHING)
    triton, sidecar = container(docs, "tritonserver"), container(docs, "openai")
    ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    seen = gateway_config(sidecar, monkeypatch)
    config = seen["config"]
    assert config.triton_url == f"localhost:{ports['grpc']}"
    assert config.metrics_url == f"http://localhost:{ports['metrics']}/metrics"
    assert config.model_dir == env_of(triton)["PAGEDLLM_MODEL_DIR"]
    assert config.served_model_name == "qwen" and config.trust_request_chat_template
    assert seen["host"] == "0.0.0.0"  # reachable from the Service and the endpoint picker
    assert [p["containerPort"] for p in sidecar["ports"]] == [seen["port"]]
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/health"


def test_gateway_sidecar_runs_what_compose_runs(
    defaults: Doc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's default sidecar and docker-compose.yml's openai service: the same
    `pagedllm openai` (parsed by the real CLI), but for where tritonserver is (the pod's
    localhost, compose's service name)."""
    monkeypatch.delenv("PAGEDLLM_TRUST_REQUEST_CHAT_TEMPLATE", raising=False)
    sidecar = gateway_config(container(defaults, "openai"), monkeypatch)
    compose = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))["services"]["openai"]
    argv = [compose_default(word) for word in compose["command"]]
    composed = gateway_config({"command": argv[:2], "args": argv[2:]}, monkeypatch)
    trust = compose["environment"]["PAGEDLLM_TRUST_REQUEST_CHAT_TEMPLATE"]
    assert compose_default(trust) == "false"  # as the chart's default
    ours, theirs = sidecar["config"], composed["config"]
    assert ours.triton_url.replace("localhost", "tritonserver") == theirs.triton_url
    assert ours.metrics_url.replace("localhost", "tritonserver") == theirs.metrics_url
    same = ("model_dir", "served_model_name", "chat_template", "trust_request_chat_template")
    assert [getattr(ours, f) for f in same] == [getattr(theirs, f) for f in same]
    assert (sidecar["host"], sidecar["port"]) == (composed["host"], composed["port"])


def test_disabling_the_gateway_removes_it_everywhere() -> None:
    docs = render(VALUE_SETS["no-gateway"])
    assert [c["name"] for c in pod_spec(docs)["containers"]] == ["tritonserver"]
    assert "openai" not in {p["name"] for p in docs["Service"]["spec"]["ports"]}
    assert "PodDisruptionBudget" not in docs
    with pytest.raises(Exception, match="inferencePool needs gateway"):
        render({**VALUE_SETS["no-gateway"], "inferencePool": {"enabled": True}})


# ---- selectors, monitoring, autoscaling, InferencePool


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_selectors_select_the_pods_and_ports_exist(name: str) -> None:
    docs = render(VALUE_SETS[name])
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selects(docs["Deployment"]["spec"]["selector"]["matchLabels"], pod_labels)
    named = {p["name"] for c in pod_spec(docs)["containers"] for p in c["ports"]}
    service = docs["Service"]
    assert selects(service["spec"]["selector"], pod_labels)
    assert {p["targetPort"] for p in service["spec"]["ports"]} == named
    for kind in ("PodDisruptionBudget", "PodMonitor", "InferencePool"):
        if kind in docs:
            assert selects(docs[kind]["spec"]["selector"]["matchLabels"], pod_labels), kind
    if "ServiceMonitor" in docs:
        spec = docs["ServiceMonitor"]["spec"]
        assert selects(spec["selector"]["matchLabels"], service["metadata"]["labels"])
        assert [e["port"] for e in spec["endpoints"]] == ["metrics"]
    if "PodMonitor" in docs:
        endpoints = docs["PodMonitor"]["spec"]["podMetricsEndpoints"]
        assert [(e["port"], e["path"]) for e in endpoints] == [("metrics", "/metrics")]


def test_keda_scales_on_gauges_the_engine_exports() -> None:
    docs = render(EVERYTHING, release="prod", namespace="serving")
    scaled = docs["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    assert "replicas" not in docs["Deployment"]["spec"]  # KEDA's HPA owns the count
    queries = {
        m: t["metadata"]
        for t in scaled["triggers"]
        for m in re.findall(r"(vllm:\w+)\{", t["metadata"]["query"])
    }
    assert set(queries) == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    assert set(queries) <= set(GAUGES)
    assert queries["vllm:kv_cache_usage_perc"]["threshold"] == "0.8"
    for meta in queries.values():
        assert 'namespace="serving"' in meta["query"] and 'pod=~"prod-pagedllm-' in meta["query"]


def test_hpa_scales_on_gauges_the_engine_exports() -> None:
    docs = render(VALUE_SETS["servicemonitor-hpa"])
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    names = {m["pods"]["metric"]["name"] for m in hpa["metrics"]}
    assert names == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= set(GAUGES)
    assert hpa["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    with pytest.raises(Exception, match="not both"):
        render({"autoscaling": {"hpa": {"enabled": True}, "keda": {"enabled": True}}})


def test_inference_pool_targets_the_gateway_port() -> None:
    docs = render(EVERYTHING)
    spec = docs["InferencePool"]["spec"]
    gateway_port = container(docs, "openai")["ports"][0]["containerPort"]
    assert spec["targetPorts"] == [{"number": gateway_port}]
    assert spec["endpointPickerRef"]["port"]["number"] == 9002


def test_values_are_documented() -> None:
    """values.yaml line by line: each key has an inline comment or a comment right above."""
    lines = (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()
    keys = [n for n, line in enumerate(lines) if re.match(r"^\s*(- )?[\w./-]+:", line)]
    assert len(keys) > 80
    for n in keys:
        documented = "#" in lines[n] or lines[n - 1].lstrip().startswith("#")
        assert documented, f"values.yaml:{n + 1}: {lines[n]}"
