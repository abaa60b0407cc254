"""Every Triton kernel of the package compiled for real GPUs (sm_80 A100, sm_89 L4/L40S, sm_90
H100/H200, sm_100 B200) with no GPU: the launches the runtime makes, recorded through the
project's own launchers over the model shapes we claim (pagedllm.layers.kernel_compile), then
lowered to cubin by the `triton` wheel's own ptxas, whose report gives registers and spills.

Runs `scripts/kernel_report.py` once, in a process without the interpreter (220 launches per
architecture; 37 min on two cores shared with seven other jobs, far less on idle ones);
docs/gpu.md's resource table must be the one it prints."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def nvidia_backend() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    spec = importlib.util.find_spec("triton.backends.nvidia")
    return (
        spec is not None
        and spec.origin is not None
        and (Path(spec.origin).parent / "bin" / "ptxas-blackwell").exists()
    )


pytestmark = pytest.mark.skipif(
    not nvidia_backend(), reason="this triton wheel has no NVIDIA backend (no ptxas)"
)


def compile_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return env


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("kernels") / "report.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "kernel_report.py"), "--out", str(out)],
        env=compile_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_every_kernel_is_compiled_for_every_architecture(report: dict[str, Any]) -> None:
    # discovered = every @triton.jit function in the package; a kernel no launcher reaches fails
    assert len(report["kernels"]) >= 5
    assert report["launched"] == report["kernels"]
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100"):
        names = {r["kernel"] for r in report["rows"] if r["arch"] == arch}
        assert names == {k.split(":")[1] for k in report["kernels"]}, arch
    assert all(r["cubin_bytes"] > 0 for r in report["rows"])


def test_dtypes_and_head_dims_we_claim_are_covered(report: dict[str, Any]) -> None:
    decode = [r for r in report["rows"] if r["kernel"] == "_decode_kernel"]
    prefill = [r for r in report["rows"] if r["kernel"] == "_prefill_kernel"]
    assert {r["dtype"] for r in decode} == {"fp16", "bf16", "fp32"}
    assert {r["constexprs"]["BLOCK_D"] for r in decode + prefill} == {64, 128, 256}
    # split-K on and off, MHA (group 1, specialized) and GQA
    assert {r["constexprs"]["SPLIT"] for r in decode} == {True, False}
    assert any(r["constexprs"].get("group") == 1 for r in decode)
    # every combination of a sliding window and a logit soft-cap, at every head dim and dtype
    kinds = {(w, c) for w in (True, False) for c in (True, False)}
    for rows in (decode, prefill):
        for dtype in ("fp16", "bf16", "fp32"):
            for width in (128, 256):
                seen = {
                    (r["constexprs"]["USE_WINDOW"], r["constexprs"]["SOFTCAP"])
                    for r in rows
                    if r["dtype"] == dtype and r["constexprs"]["BLOCK_D"] == width
                }
                assert seen == kinds, (rows[0]["kernel"], dtype, width)
    # attention sinks (gpt-oss, head dim 64: windowed and global layers, decode split and not,
    # the split's reduction) in every dtype
    for rows in (decode, prefill):
        for dtype in ("fp16", "bf16", "fp32"):
            seen = {
                r["constexprs"]["USE_WINDOW"]
                for r in rows
                if r["dtype"] == dtype and r["constexprs"]["SINKS"]
            }
            assert seen == {True, False}, (rows[0]["kernel"], dtype)
    assert {r["constexprs"]["SPLIT"] for r in decode if r["constexprs"]["SINKS"]} == {True, False}
    reduce = [r for r in report["rows"] if r["kernel"] == "_reduce_splits_kernel"]
    assert {r["constexprs"]["SINKS"] for r in reduce} == {True, False}
    workloads = {w.split()[0] for r in report["rows"] for w in r["workloads"]}
    claimed = {"phi-2", "Phi-3-mini", "Llama-3-8B", "Mistral-7B", "SmolLM2-135M", "Qwen3-0.6B"}
    claimed |= {"Gemma-2-2B", "Gemma-2-27B", "Gemma-3-270M", "Gemma-3-4B", "gpt-oss-20b"}
    assert claimed <= workloads


def test_moe_tiles_and_dtypes_we_claim_are_covered(report: dict[str, Any]) -> None:
    """The fused-MoE kernels (layers/moe_workloads.py): decode (16-row) and prefill (32- and
    64-row) tiles in every dtype, with and without biases, SwiGLU and gpt-oss's clamped one."""
    for kernel in ("_moe_gate_up_kernel", "_moe_down_kernel"):
        rows = [r for r in report["rows"] if r["kernel"] == kernel]
        for dtype in ("fp16", "bf16", "fp32"):
            tiles = {r["constexprs"]["BLOCK_M"] for r in rows if r["dtype"] == dtype}
            assert tiles == {16, 32, 64}, (kernel, dtype)
        assert {r["constexprs"]["HAS_BIAS"] for r in rows} == {True, False}, kernel
    gate_up = [r for r in report["rows"] if r["kernel"] == "_moe_gate_up_kernel"]
    assert {r["constexprs"]["ACTIVATION"] for r in gate_up} == {"silu", "swiglu_oai"}
    labels = {w for r in gate_up for w in r["workloads"]}
    models = {w.split()[1] for w in labels if w.startswith("moe ")}
    assert models == {"Mixtral-8x7B", "Qwen3-30B-A3B", "gpt-oss-20b"}


def test_gated_delta_shapes_and_dtypes_we_claim_are_covered(report: dict[str, Any]) -> None:
    """The Gated-DeltaNet kernels (layers/gdn_workloads.py): the conv's prefill (16-token) and
    decode (1-token) tiles and its state update, the recurrent delta rule at 1, 2 and 3 value
    heads per key head, in every dtype, over the Qwen3.5 / Qwen3-Next shapes."""
    rows = {k: [r for r in report["rows"] if r["kernel"] == k] for k in GDN_KERNELS}
    for dtype in ("fp16", "bf16", "fp32"):
        conv = rows["_conv1d_kernel"]
        assert {r["constexprs"]["BLOCK_T"] for r in conv if r["dtype"] == dtype} == {1, 16}
        assert any(r["dtype"] == dtype for r in rows["_conv_state_kernel"]), dtype
        groups = {
            r["constexprs"]["GROUP"] for r in rows["_recurrent_kernel"] if r["dtype"] == dtype
        }
        assert groups == {1, 2, 3}, dtype
    labels = {w for r in rows["_recurrent_kernel"] for w in r["workloads"]}
    assert {w.split()[1] for w in labels} == {"Qwen3.5-0.8B", "Qwen3-Next-80B", "Qwen3.5-27B"}


GDN_KERNELS = ("_conv1d_kernel", "_conv_state_kernel", "_recurrent_kernel")


def test_latent_attention_shapes_and_dtypes_we_claim_are_covered(report: dict[str, Any]) -> None:
    """The MLA kernels (layers/mla_workloads.py): the latent write and the absorbed decode at
    DeepSeek's 512-wide latent + 64 rope dims, split and not (and the split's reduction at that
    width), in every dtype."""
    rows = report["rows"]
    decode = [r for r in rows if r["kernel"] == "_mla_decode_kernel"]
    for dtype in ("fp16", "bf16", "fp32"):
        on = [r for r in decode if r["dtype"] == dtype]
        assert {r["constexprs"]["SPLIT"] for r in on} == {True, False}, dtype
        assert {(r["constexprs"]["BLOCK_D"], r["constexprs"]["BLOCK_P"]) for r in on} == {(512, 64)}
        assert any(r["kernel"] == "_write_latent_kernel" and r["dtype"] == dtype for r in rows)
        reduce = [r for r in rows if r["kernel"] == "_reduce_splits_kernel"]
        assert any(r["constexprs"]["BLOCK_D"] == 512 and r["dtype"] == dtype for r in reduce)
    labels = {w for r in decode for w in r["workloads"]}
    assert {w.split()[1] for w in labels} == {"DeepSeek-V3", "DeepSeek-V2-Lite"}


def test_shared_memory_fits_and_blocks_are_resident(report: dict[str, Any]) -> None:
    for r in report["rows"]:
        where = f"{r['kernel']} {r['dtype']} {r['arch']}"
        assert r["shared"] <= r["shared_limit"], where
        assert r["warps_per_sm"] >= r["num_warps"], where


def test_no_register_spills(report: dict[str, Any]) -> None:
    """fp16 and bf16 (every production model) and fp32 (the parity runs) alike."""
    spilled = [
        (r["kernel"], r["dtype"], r["arch"], r["constexprs"], r["spill_stores"])
        for r in report["rows"]
        if r["spill_stores"] or r["spill_loads"]
    ]
    assert not spilled


def test_docs_show_this_table(report: dict[str, Any]) -> None:
    from pagedllm.layers.kernel_compile import markdown

    text = (ROOT / "docs" / "gpu.md").read_text()
    found = re.search(r"<!-- kernel-report -->\n(.*?)<!-- /kernel-report -->", text, re.S)
    assert found, "docs/gpu.md lacks the kernel-report block"
    assert found.group(1) == markdown(report["rows"]), (
        "regenerate it: python scripts/kernel_report.py --markdown"
    )


SPILLING = """
import torch
from pagedllm.layers.attention.triton_launch import KernelConfig
from pagedllm.layers.attention.triton_prefill import paged_prefill
from pagedllm.layers.kernel_compile import compile_launch, Launch, recording
with recording(80) as seen:  # fp32, head dim 128, 64-key tiles at 4 warps
    q = torch.zeros(70, 8, 128)
    cache = torch.zeros(8, 2, 8, 16, 128)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    paged_prefill(q.clone(), q, cache, i32([[0, 1, 2, 3, 4]]), i32([0, 70]), i32([70]),
                  i32([0, 0]), i32([0, 64]), 0.1, None,
                  KernelConfig(prefill_block_n=64, num_warps=4))
(kernel, spec), = seen
row = compile_launch(Launch(kernel, 80, spec, ("probe",)))
print(row["spill_stores"], row["registers"])
"""


def test_the_report_sees_a_spilling_configuration(tmp_path: Path) -> None:
    """The measurement can fail: fp32 prefill with 64-key tiles at 4 warps spills KBs."""
    done = subprocess.run(
        [sys.executable, "-c", SPILLING],
        env={**compile_env(), "TRITON_CACHE_DIR": str(tmp_path)},  # fresh: ptxas runs
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stores, registers = map(int, done.stdout.split()[-2:])
    assert stores > 1000 and registers > 0


def test_fp8_kv_cache_kernels(tmp_path: Path) -> None:
    """The write, decode (split and not) and prefill kernels over fp8 caches: e5m2 compiles
    for every architecture, e4m3 for sm_89 and newer (sm_80 refuses it: so does the engine,
    kv_cache_dtype.check_fp8_e4m3), with no spills and the shared memory within bounds."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "kv_fp8_report.py")],
        env=compile_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout)["rows"]
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100"):
        for fmt in ("fp8_e4m3", "fp8_e5m2"):
            on = [r for r in rows if r["arch"] == arch and any(fmt in w for w in r["workloads"])]
            kernels = {r["kernel"] for r in on if "refused" not in r}
            if arch == "sm_80" and fmt == "fp8_e4m3":  # the reduction reads no fp8
                assert kernels == {"_reduce_splits_kernel"}, kernels
                continue
            want = {"_write_kv_kernel", "_decode_kernel", "_prefill_kernel"}
            assert want <= kernels, (arch, fmt)
    compiled = [r for r in rows if "refused" not in r]
    assert all(r["spill_stores"] == r["spill_loads"] == 0 for r in compiled)
    assert all(r["shared"] <= r["shared_limit"] for r in compiled)
    assert {r["constexprs"]["BLOCK_D"] for r in compiled if r["kernel"] == "_decode_kernel"} == {
        64,
        128,
        256,
    }
