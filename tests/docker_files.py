"""For tests/test_docker.py: the facts the GPU image's pins were checked against, a Dockerfile
parser (the subset of the syntax this repository uses), docker-compose helpers, what the
repository says (engine settings, pins, config.pbtxt), and the linters of the dev extra."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

GIB = 1 << 30
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
# a GPU cold start: weights, every Triton kernel compiled (empty cache), CUDA graphs captured
MIN_START_PERIOD_S = 600
# what the files said while the engine had no GPU path
STALE = re.compile(r"not built yet|runner is pending|runner lands|runs on the CPU (even|anyway)")


# ---- Facts looked up for the GPU image (no Docker or GPU here: recorded with their source)


@dataclass(frozen=True)
class NgcImage:
    cuda: str  # the CUDA release the image is built on
    driver: int  # the NVIDIA driver branch that CUDA release needs on the host


# NVIDIA's "Triton Inference Server Release 24.10" notes: "based on CUDA 12.6.2 which requires
# NVIDIA Driver release 560 or later" (data-center GPUs also R470/R525/R535/R545 through the
# forward-compatibility package); Ubuntu 22.04, Python 3.10; Triton 2.51.
NGC_IMAGES = {"24.10-py3": NgcImage(cuda="12.6.2", driver=560)}
# torch's CUDA builds (download.pytorch.org/whl/<tag>, local version +<tag>) -> CUDA release;
# PyTorch's release matrix lists CUDA 12.6 and 13.0 as the stable builds of 2.13.
TORCH_CUDA_BUILDS = {"cu126": "12.6", "cu130": "13.0"}
# `Requires-Dist: triton==3.7.1` in torch-2.13.0-cp310-cp310-manylinux_2_28_x86_64.whl's
# METADATA (PyPI), next to cuda-toolkit==13.0.3: the triton torch was built and tested with.
TORCH_REQUIRES_TRITON = {"2.13.0": "3.7.1"}


# ---- Dockerfile parsing (the subset of the syntax this repository uses)


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comment lines dropped (also inside a
    continuation, as Docker does)."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#") or (not parts and not line):
            continue
        if not parts:
            start = number
        if line.endswith("\\"):
            parts.append(line[:-1].strip())
            continue
        parts.append(line)
        keyword, _, args = " ".join(p for p in parts if p).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    assert not parts, "the Dockerfile ends inside a line continuation"
    return out


_VAR = re.compile(r"\$(?:\{(\w+)(?::?-([^}]*))?\}|(\w+))")


def expand(text: str, variables: dict[str, str]) -> str:
    """$VAR, ${VAR} and ${VAR:-default} with the given values (else the default, else '')."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        return variables.get(name) or m.group(2) or ""

    return _VAR.sub(sub, text)


def split_flags(args: str) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    words = shlex.split(args)
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words


@dataclass
class Dockerfile:
    instructions: list[Instruction]

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def stage(self) -> list[Instruction]:
        """The instructions of the final build stage (after its FROM)."""
        froms = [n for n, i in enumerate(self.instructions) if i.keyword == "FROM"]
        assert froms, "no FROM"
        return self.instructions[froms[-1] :]

    def global_args(self) -> dict[str, str]:
        """ARG defaults declared before the first FROM (the ones FROM may use)."""
        args: dict[str, str] = {}
        for i in self.instructions:
            if i.keyword == "FROM":
                break
            if i.keyword == "ARG":
                name, _, default = i.args.partition("=")
                args[name.strip()] = default.strip().strip('"')
        return args

    def stage_args(self) -> dict[str, str]:
        """ARG defaults a RUN of the final stage sees (global ones only once redeclared)."""
        declared = self.global_args()
        args: dict[str, str] = {}
        for i in self.stage():
            if i.keyword == "ARG":
                name, eq, default = i.args.partition("=")
                args[name.strip()] = default.strip().strip('"') if eq else declared[name.strip()]
        return args

    def base_image(self) -> str:
        return expand(self.stage()[0].args.split()[0], self.global_args())

    def env(self) -> dict[str, str]:
        """ENV of the final stage, values expanded as Docker does, in order."""
        env: dict[str, str] = {}
        for i in self.stage():
            if i.keyword != "ENV":
                continue
            words = shlex.split(i.args)
            if words and "=" not in words[0]:  # legacy form: ENV KEY value with spaces
                env[words[0]] = expand(" ".join(words[1:]), env)
                continue
            for word in words:
                key, _, value = word.partition("=")
                env[key] = expand(value, env)
        return env

    def workdir_at(self, target: Instruction) -> str:
        workdir = "/"
        for i in self.stage():
            if i is target:
                break
            if i.keyword == "WORKDIR":
                workdir = str(Path(workdir) / i.args)
        return workdir

    def copies(self) -> Iterator[tuple[list[str], str]]:
        """(sources relative to the build context, absolute destination) of each COPY/ADD
        from the context (not from another stage)."""
        for i in self.stage():
            if i.keyword not in ("COPY", "ADD"):
                continue
            flags, words = split_flags(i.args)
            if "from" in flags:
                continue
            assert len(words) >= 2, f"line {i.line}: {i.keyword} needs a source and a dest"
            dest = words[-1]
            if not dest.startswith("/"):
                dest = str(Path(self.workdir_at(i)) / dest)
            yield words[:-1], dest.rstrip("/") or "/"

    def command(self) -> list[str]:
        """ENTRYPOINT + CMD of the final stage, both required in exec (JSON) form so that
        signals reach tritonserver."""
        argv: list[str] = []
        for keyword in ("ENTRYPOINT", "CMD"):
            found = [i for i in self.stage() if i.keyword == keyword]
            if not found:
                continue
            value = json.loads(found[-1].args)
            assert isinstance(value, list), f"{keyword} must use the exec (JSON) form"
            argv += value
        return argv

    def served(self, context: Path) -> dict[str, Path]:
        """Container path of each --model-repository -> the repository directory copied there."""
        copied = {dest: srcs for srcs, dest in self.copies()}
        argv = self.command()
        repos = flag_values(argv, "--model-repository") + flag_values(argv, "--model-store")
        result: dict[str, Path] = {}
        for repo in repos:
            srcs = copied.get(repo.rstrip("/"))
            assert srcs, f"--model-repository={repo} is not a COPY destination ({sorted(copied)})"
            assert len(srcs) == 1, f"{repo} is assembled from several sources {srcs}"
            result[repo.rstrip("/")] = (context / srcs[0]).resolve()
        return result

    def runs(self) -> list[str]:
        return [i.args for i in self.stage() if i.keyword == "RUN"]

    def healthcheck(self) -> str:
        (check,) = self.of("HEALTHCHECK")
        _, _, command = check.args.partition("CMD")
        return command.strip()


# ---- Compose helpers


def compose_default(value: Any) -> str:
    """A compose value with ${VAR:-default} interpolated to its default (the host
    environment is deliberately ignored: the file must work without one)."""
    return expand(str(value), {}).replace("$$", "$")


def parse_bytes(value: Any) -> int:
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", str(value).strip().lower())
    assert m, f"not a byte size: {value!r}"
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": GIB}[m.group(2)])


def parse_duration(value: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def port_pairs(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port."""
    pairs: dict[int, int] = {}
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            pairs[int(entry["target"])] = int(entry.get("published", entry["target"]))
            continue
        fields = compose_default(entry).split("/")[0].split(":")
        assert len(fields) >= 2, f"port {entry!r} is not published on the host"
        pairs[int(fields[-1])] = int(fields[-2])
    return pairs


def url_port(text: str) -> tuple[int, str]:
    m = re.search(r"https?://(?:localhost|127\.0\.0\.1):(\d+)(/[\w/.-]*)", text)
    assert m, f"no local URL in {text!r}"
    return int(m.group(1)), m.group(2)


def flag_values(argv: list[str], flag: str) -> list[str]:
    values = []
    for n, word in enumerate(argv):
        if word.startswith(flag + "="):
            values.append(word.split("=", 1)[1])
        elif word == flag and n + 1 < len(argv):
            values.append(argv[n + 1])
    return values


class RecordingEnviron(dict[str, str]):
    """An os.environ stand-in that remembers which variables were looked up."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.looked_up: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.looked_up.add(str(key))
        return super().__contains__(key)


# ---- What the repository says


def run_engine_config(
    environ: dict[str, str], parameters: dict[str, str]
) -> tuple[set[str], dict[str, Any]]:
    """settings.engine_config() under this environment, with EngineConfig.create replaced
    by a recorder: (the PAGEDLLM_* variables it looked up, what it created the config with)."""
    from pagedllm.config import EngineConfig
    from pagedllm.serving import settings

    env = RecordingEnviron(environ)
    created: dict[str, Any] = {}

    def create(model_dir: str, **kwargs: Any) -> None:
        created.update(kwargs, model_dir=model_dir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineConfig, "create", staticmethod(create))
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


def engine_pbtxt() -> tuple[str, dict[str, str]]:
    """llm_engine's instance kind (GPU, CPU, MODEL, AUTO) and parameters, comments dropped."""
    text = re.sub(r"#.*", "", ENGINE_CONFIG_PBTXT.read_text(encoding="utf-8"))
    (kind,) = re.findall(r"instance_group\s*\[\s*\{[^}]*kind:\s*KIND_(\w+)", text)
    pattern = r'parameters\s*\{\s*key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"'
    return kind, dict(re.findall(pattern, text))


def device_on_a_gpu_host(environ: dict[str, str]) -> tuple[str, str]:
    """(llm_engine's instance kind, the device its engine resolves) under this environment,
    where Triton and torch see one GPU (Triton makes KIND_AUTO a KIND_GPU there)."""
    import torch

    from pagedllm.config import resolve_device
    from pagedllm.serving import settings

    kind, parameters = engine_pbtxt()
    kind = {"AUTO": "GPU"}.get(kind, kind)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings.os, "environ", environ)
        for name, value in [("is_available", True), ("device_count", 1), ("current_device", 0)]:
            mp.setattr(torch.cuda, name, lambda v=value: v)
        mp.setattr(torch.cuda, "get_device_name", lambda index=0: "stand-in GPU")
        return kind, resolve_device(settings.instance_device(parameters, kind, 0))


def torch_install(dockerfile: Dockerfile) -> str:
    (run,) = [r for r in dockerfile.runs() if re.search(r"pip install [^&]*\"torch==", r)]
    return run


# ---- linters (dev extra)

LINTERS = {
    # tool: (arguments, the file it checks, a file it must reject)
    "hadolint": (["--no-color"], "docker/Dockerfile", "FROM ubuntu\nRUN apt-get install curl\n"),
    "shellcheck": (["--color=never"], "docker/serve.sh", "#!/bin/bash\nrm -rf $1/\n"),
}


def lint(tool: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a linter of the dev extra (the venv's, else the PATH's); skip the test without it."""
    exe = shutil.which(tool, path=str(Path(sys.executable).parent)) or shutil.which(tool)
    if exe is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[dev]')")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def compose_schema_errors(compose: dict[str, Any]) -> list[str]:
    """Violations of the official compose-spec JSON schema, as vendored by check-jsonschema
    (PyPI); skips the test where that package is not installed."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema")
    from importlib.resources import files

    vendor = files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendor.joinpath("compose-spec.json").read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    return [f"{list(e.path)}: {e.message}" for e in errors]
