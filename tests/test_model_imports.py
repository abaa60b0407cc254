"""Triton starts a stub process per model to complete its config and then one per instance
(the tokenizer has two): none of them may import torch but the engine's instance, which
needs it. torch costs each 2-3 s of CPU at every server start and a few hundred MB of memory
for as long as it runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedllm.serving.pytriton_wheel import stub_model

REPO = Path(__file__).resolve().parents[1] / "model_repository"
MODELS = sorted(p.name for p in REPO.iterdir() if (p / "1" / "model.py").exists())


def pagedllm_imports(model: str, top_level_only: bool) -> list[str]:
    """The pagedllm modules a model's model.py imports: at its top (what any stub of it runs),
    or anywhere (with its instance's `initialize`)."""
    tree = ast.parse((REPO / model / "1" / "model.py").read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module]
    return sorted({m for m in names if m.split(".")[0] == "pagedllm"})


def heavy_modules_imported(modules: list[str]) -> list[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


@pytest.mark.parametrize("model", MODELS)
def test_no_stub_but_the_engine_instance_imports_torch(model: str) -> None:
    modules = pagedllm_imports(model, top_level_only=model == "llm_engine")
    assert modules, f"{model}/1/model.py imports nothing of pagedllm: the parse is wrong"
    assert heavy_modules_imported(modules) == [], f"{model}: via {modules}"


def test_the_engine_instance_does_import_torch() -> None:
    """The oracle of the test above: the same check sees torch where it is imported."""
    assert heavy_modules_imported(pagedllm_imports("llm_engine", top_level_only=False))


def test_building_an_engine_imports_neither_dynamo_nor_sympy(checkpoints: dict[str, Path]) -> None:
    """Each costs seconds of CPU at every engine start (torch imports them on demand: an
    nn.Embedding initialized on the meta device, `to_empty`'s meta empty_like)."""
    code = (
        "import sys\n"
        "from pagedllm import LLM\n"
        f"llm = LLM({str(checkpoints['llama'])!r}, dtype='float32')\n"
        "assert llm.generate(['Hello'])[0].outputs[0].token_ids\n"
        "print(','.join(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1:] in ([], [""]), out.stdout


SHARES_SERVER = True


def test_a_running_server_maps_libtorch_in_the_engine_stub_alone(server: Any) -> None:
    """The same, read from the stubs of a real server: which of them have libtorch mapped."""
    import psutil

    stubs: dict[str, list[bool]] = {}
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        model = stub_model(proc.cmdline())
        if model is not None:
            torch_mapped = any("libtorch" in m.path for m in proc.memory_maps())
            stubs.setdefault(model, []).append(torch_mapped)
    assert sorted(stubs) == MODELS
    assert stubs.pop("llm_engine") == [True]
    assert stubs == {model: [False] * len(v) for model, v in stubs.items()}
