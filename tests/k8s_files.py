"""For tests/test_helm.py and tests/test_kserve.py: the Helm chart rendered and linted by Helm's
own Go code (helm-python-sdk: the Helm v4 SDK in a shared library in its wheel — no helm
binary, nothing downloaded), each manifest validated against the Kubernetes API schemas
(kubernetes-validate, strict) or, for custom resources, against the upstream CRD schemas
vendored in tests/k8s_schemas/ (README there: sources and versions)."""

from __future__ import annotations

import gzip
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_files import ROOT

Doc = dict[str, Any]
CHART = ROOT / "deploy" / "helm" / "pagedllm"
KSERVE = ROOT / "deploy" / "kserve"
GATEWAY = ROOT / "deploy" / "gateway"
SCHEMAS = Path(__file__).parent / "k8s_schemas"
# the oldest Kubernetes the chart allows (Chart.yaml kubeVersion) and the newest known
K8S_VERSIONS = ("1.25.0", "1.37.0")
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobject_v1alpha1.json.gz",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitor_v1.json.gz",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "monitoring.coreos.com_servicemonitor_v1.json.gz"
    ),
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): (
        "serving.kserve.io_clusterservingruntime_v1alpha1.json.gz"
    ),
    ("serving.kserve.io/v1beta1", "InferenceService"): (
        "serving.kserve.io_inferenceservice_v1beta1.json.gz"
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproute_v1.json.gz",
    ("inference.networking.k8s.io/v1", "InferencePool"): (
        "inference.networking.k8s.io_inferencepools_crd-v1.6.0.yaml.gz"
    ),
}
# tritonserver's --exit-timeout-secs default (Triton 2.51 `tritonserver --help`: 30 seconds)
TRITON_EXIT_TIMEOUT_S = 30


# ---- the chart


def render(values: Doc | None = None, release: str = "pagedllm", namespace: str = "llm") -> Doc:
    """The chart's manifests with these values over values.yaml, by kind (one of each)."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra")
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name=release, namespace=namespace, is_install=True)
    docs: Doc = {}
    for path, text in sorted(out.items()):
        for doc in yaml.safe_load_all(text) if path.endswith(".yaml") else ():
            if doc:
                assert doc["kind"] not in docs, f"two {doc['kind']}s"
                docs[doc["kind"]] = doc
    return docs


def lint(chart: Path) -> list[str]:
    """`helm lint --strict` findings above info level, as text."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra")
    report = helm.lint(str(chart), strict=True)
    found = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] > 1]
    return found + list(report["errors"])


def container(docs: Doc, name: str) -> Doc:
    (found,) = [c for c in pod_spec(docs)["containers"] if c["name"] == name]
    return found


def pod_spec(docs: Doc) -> Doc:
    spec: Doc = docs["Deployment"]["spec"]["template"]["spec"]
    return spec


def flags(args: list[str]) -> dict[str, list[str]]:
    """--name=value arguments by name (repeatable)."""
    out: dict[str, list[str]] = {}
    for arg in args:
        m = re.fullmatch(r"--([\w-]+)=(.*)", arg)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def load_yaml(path: Path) -> Doc:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


# ---- schemas


@cache
def _schema(key: tuple[str, str]) -> Doc:
    raw = gzip.decompress((SCHEMAS / CRD_SCHEMAS[key]).read_bytes()).decode()
    if not CRD_SCHEMAS[key].endswith(".yaml.gz"):
        schema: Doc = json.loads(raw)
        return schema
    return crd_schema(yaml.safe_load(raw), key[0].split("/")[1])


def crd_schema(crd: Doc, version: str) -> Doc:
    """A CRD version's openAPIV3Schema as a strict JSON schema (unknown fields rejected, as
    the API server prunes them), the conversion the other vendored schemas had."""
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]

    def strict(node: Any) -> Any:
        if isinstance(node, list):
            return [strict(n) for n in node]
        if not isinstance(node, dict):
            return node
        node = {k: strict(v) for k, v in node.items()}
        open_ = "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in node and not open_:
            node["additionalProperties"] = False
        return node

    out: Doc = strict(v["schema"]["openAPIV3Schema"])
    return out


def schema_errors(doc: Doc) -> list[str]:
    """Where `doc` breaks its schema: a custom resource's vendored CRD schema, else the
    Kubernetes API's of every version in K8S_VERSIONS (strict)."""
    jsonschema = pytest.importorskip("jsonschema")
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        schema = _schema(key)
        validator = jsonschema.validators.validator_for(schema)(schema)
        return [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate: dev extra")
    errors = []
    for version in K8S_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            errors.append(f"{doc['kind']} on {version}: {list(e.path)}: {e.message}")
    return errors


# ---- what the image does when it stops (docker/serve.sh)


def serve_sh_default(variable: str) -> str:
    """The default docker/serve.sh gives `variable` (its `${VAR:-default}`)."""
    text = (ROOT / "docker" / "serve.sh").read_text(encoding="utf-8")
    (default,) = set(re.findall(rf"\${{{variable}:-([^}}]*)\}}", text))
    return default


def stop_budget(env: dict[str, str], args: list[str], pre_stop_s: float) -> float:
    """Seconds a pod may need from SIGTERM to exit: the pre-stop pause, serve.sh's drain wait
    and tritonserver's exit timeout, under this environment and these arguments."""
    drain_wait = float(
        env.get("PAGEDLLM_DRAIN_WAIT_S") or serve_sh_default("PAGEDLLM_DRAIN_WAIT_S")
    )
    exit_timeout = float((flags(args).get("exit-timeout-secs") or [TRITON_EXIT_TIMEOUT_S])[-1])
    return pre_stop_s + drain_wait + exit_timeout


def pre_stop_seconds(c: Doc) -> float:
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


def env_of(c: Doc) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
