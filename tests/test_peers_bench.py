"""benchmarks/peers.py cannot rot: its pagedllm part on a tiny checkpoint and budget (no
llama.cpp, no HF, no plot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"


def test_peers_quick_pagedllm_only(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--engines", "pagedllm", "--precisions"]
    cmd += ["fp32", "--model", str(checkpoints["qwen2"]), "--out", str(out), "--no-plot"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["memory_bandwidth_gbs"] > 0
    row = rep["results"]["pagedllm"]["fp32"]
    assert "error" not in row, row
    one = next(d for d in row["decode"] if d["batch"] == 1)
    assert one["tokens_per_s"] > 0 and one["bandwidth"]["fraction_of_bandwidth"] > 0
    # every request ran to its max_tokens: asserted inside the part
    assert row["mix"]["requests"] == 6 and row["mix"]["output_tokens"] >= 6 * 4
    assert row["mix"]["ttft_ms_p50"] <= row["mix"]["ttft_ms_p99"]
    assert row["perplexity"]["ppl"] > 1
    assert "| pagedllm fp32 |" in done.stdout


def test_peers_paired_mix_rounds(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """--paired-only: no parts, only the mix of ours and HF static in alternating rounds (one
    here), each round's tok/s and their ratio, and the table printed."""
    out = tmp_path / "paired.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--engines", "pagedllm,hf", "--precisions"]
    cmd += ["fp32", "--model", str(checkpoints["llama"]), "--out", str(out), "--no-plot"]
    cmd += ["--paired-only", "--paired-rounds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["results"] == {"pagedllm": {}, "hf": {}} and "paired_batch1" not in rep
    mix = rep["paired_mix"]["fp32"]
    [r] = mix["rounds"]
    assert r["pagedllm"] > 0 and r["hf"] > 0
    assert abs(r["ratio"] - r["pagedllm"] / r["hf"]) < 2e-3 and mix["ratio_median"] == r["ratio"]
    assert "| fp32 |" in done.stdout
