"""scripts/gpu_check.sh on a machine without CUDA: it says so and why, and exits 0 (CI runs it);
its pytest driver reads a run's counts and failures as the GPU check relies on."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="there the check runs: see docs/gpu.md")
def test_without_cuda_the_check_skips_with_its_reason(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["skipped"].startswith("no CUDA device")
    assert report["device"]["available"] is False and report["device"]["torch"]
    assert "parts" not in report


def test_the_pytest_driver_reads_passes_and_failures(tmp_path: Path) -> None:
    check = driver()
    good = check.pytest_part("pool", ["tests/test_block_pool.py"], 300, tmp_path / "pool.log")
    assert good["ok"] and good["passed"] > 0 and not good.get("failed")
    # its whole output kept beside the report
    assert "passed" in (tmp_path / good["log"]).read_text()
    # a run that selects nothing is not a pass
    args = ["tests/test_block_pool.py", "-k", "no_such_test"]
    none = check.pytest_part("none", args, 300, tmp_path / "none.log")
    assert none["ok"] is False and none["deselected"] > 0


def test_a_part_that_runs_out_of_time_says_so_and_keeps_its_log(tmp_path: Path) -> None:
    check = driver()
    part = check.pytest_part("slow", ["tests/test_block_pool.py"], 0.5, tmp_path / "slow.log")
    assert part["ok"] is False and "timed out" in part["error"]
    assert (tmp_path / part["log"]).exists()  # what it printed before it was stopped
