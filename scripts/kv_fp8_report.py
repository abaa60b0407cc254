"""The attention kernels over fp8 KV caches compiled for sm_80/89/90/100 with no GPU
(pagedllm.layers.kv_fp8_compile): JSON to stdout, one row per launch (registers, spills,
shared memory) or the architecture's refusal."""

from __future__ import annotations

import json
import os

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, not interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from pagedllm.layers.kv_fp8_compile import report

if __name__ == "__main__":
    print(json.dumps(report(), indent=1))
