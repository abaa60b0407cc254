"""`device`: "auto" by default everywhere, resolved once (`config.resolve_device`) to "cpu" or
"cuda:N" and logged; explicit values; clear errors; what a Triton instance's kind makes of it."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM
from pagedllm.cli import main
from pagedllm.config import ConfigError, EngineConfig, resolve_device
from pagedllm.device import torch_is_cpu_only
from pagedllm.layers.attention import create_attention_backend
from pagedllm.serving import settings
from pagedllm.serving.settings import instance_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="expects a machine without CUDA")
LOGGER = "pagedllm.device"


def device_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("device ")]


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sees two CUDA devices, the current one is cuda:1 (nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: f"Fake GPU {i}")


# --- resolution ------------------------------------------------------------------------------


@no_cuda
def test_auto_is_the_cpu_without_cuda_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, LOGGER):
        assert resolve_device("auto") == "cpu"
    assert device_lines(caplog) == ["device auto -> cpu (no CUDA device)"]


def test_explicit_cpu_in_any_spelling(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, LOGGER):
        assert resolve_device("cpu") == "cpu"
        assert resolve_device(" CPU ") == "cpu"
    assert device_lines(caplog) == ["device cpu", "device cpu"]


@pytest.mark.parametrize("bad", ["tpu", "gpu", "", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "mps"])
def test_bad_values_name_the_allowed_ones(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"unsupported device .*use one of auto, cpu, cuda, "):
        resolve_device(bad)


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_a_device_is_a_clear_error(device: str) -> None:
    with pytest.raises(ConfigError, match=r"asks for a GPU, but torch sees no CUDA device") as e:
        resolve_device(device)
    assert "use device 'auto' or 'cpu'" in str(e.value)


def test_auto_and_cuda_take_the_current_cuda_device(
    fake_gpus: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, LOGGER):
        assert resolve_device("auto") == "cuda:1"
        assert resolve_device("cuda") == "cuda:1"
        assert resolve_device("cuda:0") == "cuda:0"
    assert device_lines(caplog) == [
        "device auto -> cuda:1 (Fake GPU 1)",
        "device cuda -> cuda:1 (Fake GPU 1)",
        "device cuda:0 (Fake GPU 0)",
    ]
    with pytest.raises(ConfigError, match=r"'cuda:2': torch sees 2 CUDA device\(s\), cuda:0 to"):
        resolve_device("cuda:2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_is_the_gpu_where_there_is_one(caplog: pytest.LogCaptureFixture) -> None:
    index = torch.cuda.current_device()
    with caplog.at_level(logging.INFO, LOGGER):
        assert resolve_device("auto") == f"cuda:{index}"
    name = torch.cuda.get_device_name(index)
    assert device_lines(caplog) == [f"device auto -> cuda:{index} ({name})"]


# --- the defaults: auto, resolved before anything uses it ------------------------------------


def test_every_entry_point_defaults_to_auto() -> None:
    assert inspect.signature(LLM).parameters["device"].default == "auto"
    assert inspect.signature(EngineConfig.create).parameters["device"].default == "auto"
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert fields["device"] == "auto"


@no_cuda
def test_llm_runs_on_the_resolved_device(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, LOGGER):
        llm = LLM(str(checkpoints["llama"]), max_model_len=64, num_kv_blocks=8)
    assert llm.engine.config.device == "cpu"
    assert llm.engine.runner.device == torch.device("cpu")
    assert device_lines(caplog) == ["device auto -> cpu (no CUDA device)"]  # once


@no_cuda
def test_engine_config_is_never_left_auto(checkpoints: dict[str, Path]) -> None:
    config = EngineConfig.create(checkpoints["llama"], max_model_len=64)
    assert config.device == "cpu"
    # built directly, the default is resolved before freezing too
    assert dataclasses.replace(config, device="auto").device == "cpu"
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        EngineConfig.create(checkpoints["llama"], device="cuda")
    with pytest.raises(ConfigError, match="unsupported device 'gpu'"):
        EngineConfig.create(checkpoints["llama"], device="gpu")


def test_attention_backends_refuse_an_unresolved_device() -> None:
    with pytest.raises(ValueError, match="run on cpu or cuda, not 'auto'"):
        create_attention_backend("auto", "auto")


# --- Triton instances -------------------------------------------------------------------------


def test_instance_device_follows_the_instance_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_DEVICE", raising=False)
    auto = {"device": "auto"}
    assert instance_device({}) == "cpu"  # default: auto on a KIND_CPU instance
    assert instance_device(auto, "CPU", 0) == "cpu"
    assert instance_device(auto, "GPU", 2) == "cuda:2"  # the GPU Triton gave it
    assert instance_device(auto, "MODEL", 0) == "auto"  # EngineConfig.create decides
    assert instance_device({"device": "cuda"}, "GPU", 3) == "cuda:3"
    assert instance_device({"device": "cuda"}, "CPU", 0) == "cuda:0"
    assert instance_device({"device": "cuda"}, "MODEL", 0) == "cuda:0"
    assert instance_device({"device": "cpu"}, "GPU", 1) == "cpu"
    assert instance_device({"device": "cuda:1"}, "MODEL", 0) == "cuda:1"
    monkeypatch.setenv("PAGEDLLM_DEVICE", "Auto")  # the variable wins over the parameter
    assert instance_device({"device": "cpu"}, "GPU", 1) == "cuda:1"
    monkeypatch.setenv("PAGEDLLM_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="unsupported device 'tpu'; use one of auto, cpu"):
        instance_device({})


@no_cuda
def test_engine_config_resolves_the_instance_device(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEDLLM_DEVICE", raising=False)
    params = {"model_dir": str(checkpoints["llama"]), "max_model_len": "64"}
    assert settings.engine_config(params).device == "cpu"
    kind_model = instance_device(params, "MODEL", 0)
    assert settings.engine_config(params, kind_model).device == "cpu"
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        settings.engine_config(params, instance_device(params, "GPU", 0))


# --- the command line -------------------------------------------------------------------------


def test_serve_passes_the_device_to_the_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedllm.serving import launcher

    calls: list[dict[str, str]] = []

    def serve(model: str, *args: Any) -> int:
        calls.append(args[4])  # the models' environment
        return 0

    monkeypatch.setattr(launcher, "serve", serve)
    assert main(["serve", "--model", "/m"]) == 0
    assert main(["serve", "--model", "/m", "--device", "CUDA:1"]) == 0
    assert [c["PAGEDLLM_DEVICE"] for c in calls] == ["auto", "cuda:1"]
    with pytest.raises(SystemExit):
        main(["serve", "--model", "/m", "--device", "gpu"])
    assert "argument --device: unsupported device 'gpu'; use one of auto, cpu" in (
        capsys.readouterr().err
    )


def test_the_cpu_only_build_is_read_without_importing_torch() -> None:
    """What `pagedllm serve` reads from torch's version.py is what torch itself says."""
    assert torch_is_cpu_only() == (torch.version.cuda is None)
