"""deploy/kserve (ClusterServingRuntime, InferenceService) and deploy/gateway (HTTPRoute to the
chart's InferencePool) without a cluster: each against the upstream CRD schema it is written
for (tests/k8s_schemas), and against what the image does: its command with KServe's ports,
health checks on those ports, the metrics port docker/serve.sh reads while draining, /dev/shm,
environment variables pagedllm reads, a grace period over the drain."""

from __future__ import annotations

import pytest
import yaml
from docker_files import (
    COMPOSE_FILE,
    READY_PATH,
    ROOT,
    Dockerfile,
    compose_default,
    parse_bytes,
    parse_dockerfile,
    run_engine_config,
    source_env_names,
    url_port,
)
from k8s_files import (
    GATEWAY,
    KSERVE,
    Doc,
    env_of,
    flags,
    load_yaml,
    render,
    schema_errors,
    serve_sh_default,
    stop_budget,
)

FILES = {
    "servingruntime": KSERVE / "servingruntime.yaml",
    "inferenceservice": KSERVE / "inferenceservice.yaml",
    "httproute": GATEWAY / "httproute.yaml",
}


@pytest.fixture(scope="module")
def runtime() -> Doc:
    return load_yaml(FILES["servingruntime"])


@pytest.fixture(scope="module")
def isvc() -> Doc:
    return load_yaml(FILES["inferenceservice"])


def server_container(runtime: Doc) -> Doc:
    (c,) = runtime["spec"]["containers"]
    assert c["name"] == "kserve-container"  # the name KServe looks for
    return dict(c)


@pytest.mark.parametrize("name", sorted(FILES))
def test_matches_its_crd_schema(name: str) -> None:
    doc = load_yaml(FILES[name])
    assert schema_errors(doc) == []
    doc["spec"]["replicaz"] = 1
    assert schema_errors(doc), "the schema accepts an unknown field"


def test_runtime_runs_the_image_command_on_kserves_ports(runtime: Doc) -> None:
    dockerfile = Dockerfile(parse_dockerfile((ROOT / "docker/Dockerfile").read_text()))
    c = server_container(runtime)
    image_cmd, args = dockerfile.command(), c["args"]
    assert "command" not in c and args[0] == image_cmd[0]  # serve.sh, under NGC's entrypoint
    ours, image = flags(args), flags(image_cmd)
    assert ours["model-repository"] == image["model-repository"]
    assert set(ours) == set(image)  # the same flags, only the port numbers differ
    http = int(ours["http-port"][0])
    assert [p["containerPort"] for p in c["ports"]] == [http]  # where KServe sends requests
    for kind in ("startup", "readiness", "liveness"):
        assert c[f"{kind}Probe"]["httpGet"]["port"] == http, kind
    assert c["startupProbe"]["httpGet"]["path"] == READY_PATH
    assert c["readinessProbe"]["httpGet"]["path"] == READY_PATH
    # the drain in serve.sh reads the engine's gauges on the metrics port; so does Prometheus
    metrics = int(ours["metrics-port"][0])
    assert url_port(serve_sh_default("PAGEDLLM_METRICS_URL"))[0] == metrics
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(metrics)
    assert "v2" in runtime["spec"]["protocolVersions"]


def test_runtime_env_shm_and_gpu(runtime: Doc) -> None:
    c = server_container(runtime)
    env = env_of(c)
    engine, _ = run_engine_config({"PAGEDLLM_MODEL_DIR": "/model"}, {})
    assert set(env) <= engine | source_env_names()
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    service = compose["services"]["tritonserver"]
    default_dir = compose_default(service["environment"]["PAGEDLLM_MODEL_DIR"])
    assert env["PAGEDLLM_MODEL_DIR"] == default_dir  # the model baked into the image
    volumes = {v["name"]: v for v in runtime["spec"]["volumes"]}
    (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    empty_dir = volumes[shm["name"]]["emptyDir"]
    assert empty_dir["medium"] == "Memory"
    assert parse_bytes(empty_dir["sizeLimit"].replace("Gi", "g")) >= parse_bytes(
        service["shm_size"]
    )
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1


def test_inference_service_uses_the_runtime(runtime: Doc, isvc: Doc) -> None:
    predictor = isvc["spec"]["predictor"]
    model = predictor["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    # raw Deployment: Knative allows one port and would cut long streams at its timeout
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    c = server_container(runtime)
    budget = stop_budget(env_of(c), c["args"], pre_stop_s=0)
    assert predictor["terminationGracePeriodSeconds"] > budget


def test_httproute_sends_openai_paths_to_the_charts_inference_pool() -> None:
    route = load_yaml(FILES["httproute"])
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    pool = render({"inferencePool": {"enabled": True}}, release="pagedllm")["InferencePool"]
    assert backend["name"] == pool["metadata"]["name"]
    paths = [m["path"]["value"] for m in rule["matches"]]
    assert all("/v1/chat/completions".startswith(p) for p in paths)
