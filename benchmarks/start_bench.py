"""How long a server takes to start and stop, and the memory of each of its processes: starts
`tritonserver` over the repository (`pagedllm.serving.launcher.make_server`, what `pagedllm
serve` runs) `--rounds` times, one after another. Per round: seconds until every model is ready,
the resident and proportional memory (RSS, PSS: shared pages divided among their users) of
`tritonserver` and of each model's Python stub once ready, and seconds to stop (no request in
flight). Prints JSON and writes it to --out (default benchmarks/start-bench.json).

    .venv/bin/python benchmarks/start_bench.py [--model DIR] [--rounds 3]

Default model: SmolLM2-135M-Instruct from PyPI (`pagedllm.prepare`), as `pagedllm serve`
serves it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from pagedllm.serving.launcher import make_server
from pagedllm.serving.pytriton_wheel import stub_model


def process_memory(pid: int) -> dict[str, dict[str, float]]:
    """MiB of RSS and PSS per process of the server: "tritonserver", and each stub by its
    model's name (a model with several instances: "tokenizer#2" and so on)."""
    found: dict[str, dict[str, float]] = {}
    server = psutil.Process(pid)
    for proc in [server, *server.children(recursive=True)]:
        model = stub_model(proc.cmdline())
        name = "tritonserver" if proc.pid == pid else model or proc.name()
        key, n = name, 1
        while key in found:
            n += 1
            key = f"{name}#{n}"
        mem = proc.memory_full_info()
        found[key] = {"rss_mib": round(mem.rss / 2**20, 1), "pss_mib": round(mem.pss / 2**20, 1)}
    return found


def one_start(model: str, dtype: str, quantization: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        server = make_server(model, dtype=dtype, quantization=quantization, work_dir=Path(work))
        with server:
            ready = time.perf_counter() - start
            assert server.process is not None
            memory = process_memory(server.process.pid)
            stop = time.perf_counter()
        stopped = time.perf_counter() - stop
    total = {k: round(sum(m[k] for m in memory.values()), 1) for k in ("rss_mib", "pss_mib")}
    return {"ready_s": round(ready, 2), "stop_s": round(stopped, 2), "memory": memory} | total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a model directory (default: SmolLM2 from PyPI)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/start-bench.json"))
    args = parser.parse_args()
    if args.model is None:
        from pagedllm.prepare import prepare_smollm2

        args.model = str(prepare_smollm2())
    runs = [one_start(args.model, args.dtype, args.quantization) for _ in range(args.rounds)]
    result = {
        "model": args.model,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "ready_s_median": statistics.median(r["ready_s"] for r in runs),
        "stop_s_median": statistics.median(r["stop_s"] for r in runs),
        "pss_mib_median": statistics.median(r["pss_mib"] for r in runs),
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
