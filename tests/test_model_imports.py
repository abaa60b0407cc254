"""The Triton models that tokenize, detokenize or translate a client's contract run in stub
processes of their own (the tokenizer in two): none of them may import torch, which costs each
2-3 s of CPU at every server start and a few hundred MB for as long as it runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1] / "model_repository"
LIGHT = sorted(p.name for p in REPO.iterdir() if (p / "1" / "model.py").exists())
LIGHT.remove("llm_engine")


def pagedllm_imports(model: str) -> list[str]:
    """The pagedllm modules a model's model.py imports, as its stub would."""
    tree = ast.parse((REPO / model / "1" / "model.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    return sorted({m for m in names if m.split(".")[0] == "pagedllm"})


@pytest.mark.parametrize("model", LIGHT)
def test_a_light_model_imports_no_torch(model: str) -> None:
    modules = pagedllm_imports(model)
    assert modules, f"{model}/1/model.py imports nothing of pagedllm: the parse is wrong"
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{model} imports {out.stdout.strip()} via {modules}"


def test_the_engine_model_does_import_torch() -> None:
    """The oracle of the test above: the same check sees torch where it is imported."""
    modules = pagedllm_imports("llm_engine")
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
