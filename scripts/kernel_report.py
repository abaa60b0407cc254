"""The resource table of every Triton kernel launch, compiled for sm_80/89/90/100 with no GPU
(see pagedllm.layers.kernel_compile): JSON to --out (default benchmarks/kernel-report.json),
and with --markdown the table docs/gpu.md shows."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, not interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from pagedllm.layers.kernel_compile import ARCHS, markdown, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/kernel-report.json"))
    parser.add_argument("--arch", type=int, action="append", choices=sorted(ARCHS))
    parser.add_argument("--workers", type=int)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    result = report(args.arch, args.workers)
    result["seconds"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.markdown:
        sys.stdout.write(markdown(result["rows"]))


if __name__ == "__main__":
    main()
