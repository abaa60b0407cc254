"""The GPU check: everything the GPU path claims, on whatever CUDA device this machine has, in
one unattended run (under 10 minutes on an H100), each part in a process of its own; writes one
JSON document and prints a summary. Exit status 1 when any part fails; 0 with a `skipped`
reason on a machine without CUDA. Run from the source tree on the machine's own torch (>= 2.11):
no install, no download. See docs/gpu.md ("The GPU check").

    bash scripts/gpu_check.sh [--out gpu-check.json] [--no-big] [--budget S] [--parts a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 570  # the lent machine allows 600 s a command
PARTS = ("gpu_tests", "parity", "engine", "tritonserver", "bench")
# engine-level tests that run on the device by themselves (device auto) and check it against an
# oracle: generation, log-probs against HF, structured outputs (the GPU bitmask kernel), bad words
ENGINE_TESTS = [
    "tests/test_generation.py",
    "tests/test_logprobs_oracle.py",
    "tests/test_structured.py",
    "tests/test_bad_words.py",
    "tests/test_bitmask.py",
]


def env() -> dict[str, str]:
    """The source tree on the path; compiled kernels (never the interpreter)."""
    paths = [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    out = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), TRITON_DEFAULT_FP_FUSION="1")
    return out


def device_info() -> dict[str, Any]:
    code = (
        "import json, torch, triton\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'triton': triton.__version__, 'available': torch.cuda.is_available()}\n"
        "if d['available']:\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d.update(name=p.name, capability=f'sm_{p.major}{p.minor}',"
        " memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)\n"
        "print(json.dumps(d))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        return {"available": False, "error": done.stderr[-2000:]}
    info: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return info


def pytest_part(name: str, args: list[str], timeout: float, log: Path) -> dict[str, Any]:
    """A pytest run: counts, and the failures' names and messages; its whole output in `log`."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:  # what it printed so far (bytes, whatever `text`)
        log.write_bytes(b"".join(o for o in (e.stdout, e.stderr) if isinstance(o, bytes)))
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "log": log.name}
    text = done.stdout + done.stderr
    log.write_text(text)
    counts = {
        word: int(n)
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", text)
    }
    failed = re.findall(r"^(?:FAILED|ERROR) (.*)$", text, re.M)
    result = {
        "ok": done.returncode == 0 and counts.get("passed", 0) > 0,
        "seconds": round(time.perf_counter() - start, 1),
        **counts,
        "failures": failed[:20],
        "log": log.name,
    }
    if not result["ok"]:
        result["tail"] = text[-3000:]
    print(f"[gpu-check] {name}: {'ok' if result['ok'] else 'FAILED'} {counts}", flush=True)
    return result


def bench_part(big: bool, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py")] + (["--big"] if big else [])
    try:
        done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"ok": False, "tail": done.stderr[-3000:]}
    result: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{") :])
    result["ok"] = True
    return result


def targets(bench: dict[str, Any]) -> dict[str, Any]:
    """docs/gpu.md's speed targets, met or not (reported; only correctness fails the check):
    decode attention at batch 32 and a 2k context >= 60 % of the bandwidth roofline (the
    nominal peak where the device is known, else a measured copy), graph decode step host
    overhead <= 10 % at batch 1."""
    key = "decode_attention_b32_ctx2048"
    roofline = bench.get(f"{key}_of_peak_bandwidth", bench.get(f"{key}_of_copy_bandwidth"))
    overhead = bench.get("graphs_host_overhead_batch1")
    return {
        "decode_attention_of_roofline": roofline,
        "decode_attention_met": None if roofline is None else roofline >= 0.6,
        "graph_step_host_overhead": overhead,
        "graph_step_overhead_met": None if overhead is None else overhead <= 0.10,
    }


def smollm2_prepared() -> bool:
    """Whether SmolLM2 is prepared here (the lent machines lack the wheel it comes from)."""
    code = "from pagedllm.prepare import default_model_dir, is_prepared as p; print(p(default_model_dir()))"
    done = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True)
    return done.stdout.strip() == "True"


def tritonserver() -> str | None:
    """The server binary: the project's own (scripts/setup.sh's venv) or one on PATH."""
    own = ROOT / ".venv" / "bin" / "tritonserver"
    return str(own) if own.exists() else shutil.which("tritonserver")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check.json")
    ap.add_argument("--no-big", action="store_true", help="skip the Llama-3-8B-shaped model")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all parts")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    args = ap.parse_args()
    chosen = set(args.parts.split(","))
    if not chosen <= set(PARTS):
        ap.error(f"unknown parts {sorted(chosen - set(PARTS))}; choose from {','.join(PARTS)}")
    start = time.perf_counter()
    report: dict[str, Any] = {"device": device_info()}
    if not report["device"].get("available"):
        report["skipped"] = "no CUDA device: nothing of the GPU path can run here"
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"[gpu-check] skipped: {report['skipped']}")
        return

    def left() -> float:
        return args.budget - (time.perf_counter() - start)

    def log(part: str) -> Path:
        return args.out.with_name(f"{args.out.stem}.{part}.log")

    parts = report["parts"] = {}
    # compiled kernels vs the reference for every claimed shape and dtype, CI's compiled
    # specializations, CUDA graphs vs eager, the KV budget from free memory, device auto,
    # quantized weights decoded for cuBLAS
    if "gpu_tests" in chosen:
        files = [
            "test_gpu_kernels",
            "test_cuda_graphs",
            "test_device",
            "test_quantization",
            "test_moe_triton",
        ]
        args_ = ["-m", "gpu", *(f"tests/{name}.py" for name in files)]
        parts["gpu_tests"] = pytest_part("gpu tests", args_, min(240, left()), log("gpu_tests"))
    # greedy parity with HF transformers, the engine on the device (device auto): batching,
    # chunked prefill, prefix hits, preemption; tiny Llama / Qwen2 / Mistral, SmolLM2 if here
    if "parity" in chosen:
        parity = ["tests/test_parity.py", "-k", "not each_attention_backend"]
        if smollm2_prepared():
            parity.append("tests/test_smollm2.py")
        parts["parity"] = pytest_part("parity", parity, min(180, left()), log("parity"))
    if "engine" in chosen:
        parts["engine"] = pytest_part("engine", ENGINE_TESTS, min(180, left()), log("engine"))
    if "tritonserver" in chosen:
        if tritonserver() is None:
            parts["tritonserver"] = {
                "ok": None,
                "skipped": "no tritonserver here (bash scripts/setup.sh installs one; the lent "
                "machines reach no registry): the engine-level parts still ran",
            }
        else:
            stream_tests = ["tests/test_server.py", "-k", "stream"]
            parts["tritonserver"] = pytest_part(
                "tritonserver", stream_tests, min(150, left()), log("tritonserver")
            )
    if "bench" in chosen:
        parts["bench"] = bench_part(not args.no_big, max(30.0, left()))
    report["targets"] = targets(parts.get("bench", {}).get("small", {}))
    failed = [name for name, part in parts.items() if part.get("ok") is False]
    report["ok"] = not failed
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"ok": report["ok"], "failed": failed, "seconds": report["seconds"]}))
    print(json.dumps({"targets": report["targets"], "bench": parts.get("bench")}, indent=1))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
