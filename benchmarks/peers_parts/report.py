"""The results as a markdown table (docs/peers.md) and as a plot (docs/peers.png)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from peers_parts import install

NAMES = {"pagedllm": "pagedllm", "llamacpp": "llama.cpp", "hf": "HF static"}
LLAMA_TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_1"}


def _decode(res: dict[str, Any], batch: int, ctx: int, key: str = "tokens_per_s") -> str:
    row = next(
        (d for d in res.get("decode", []) if d["batch"] == batch and d["context_tokens"] == ctx),
        None,
    )
    return "" if row is None else f"{row[key]:g}" if key in row else "error"


def _row(engine: str, precision: str, res: dict[str, Any]) -> str:
    name = f"{NAMES[engine]} {precision}"
    if engine == "llamacpp":
        name += f" ({LLAMA_TYPES.get(precision, '')})"
    if "skipped" in res or "error" in res:
        why = res.get("skipped") or f"error: {res['error'][:80]}"
        return f"| {name} | {why} |" + " |" * 10
    one: dict[str, Any] = next((d for d in res["decode"] if d["batch"] == 1), {})
    bw = one.get("bandwidth", {}).get("fraction_of_bandwidth", "")
    mix, ppl = res.get("mix", {}), res.get("perplexity", {})
    cells = [
        _decode(res, 1, 128),
        f"{bw}",
        _decode(res, 8, 128),
        _decode(res, 8, 1024),
        _decode(res, 32, 128),
        _decode(res, 32, 1024),
        _decode(res, 8, 1024, "prefill_tokens_per_s"),
        f"{mix.get('output_tokens_per_s', '')}",
        f"{mix.get('ttft_ms_p50', '')} / {mix.get('ttft_ms_p99', '')}",
        f"{ppl.get('ppl', '')}",
    ]
    return f"| {name} | " + " | ".join(cells) + " |"


def markdown(rep: dict[str, Any]) -> str:
    head = (
        "| engine, precision | decode b1 c128 tok/s | b1 fraction of bandwidth "
        "| b8 c128 | b8 c1k | b32 c128 | b32 c1k | prefill tok/s (8 x 1k) "
        "| mix tok/s | mix TTFT p50 / p99 ms | perplexity |\n|---" + "|---:" * 10 + "|"
    )
    rows = [
        _row(engine, precision, res)
        for engine, by_precision in rep["results"].items()
        for precision, res in by_precision.items()
    ]
    return "\n".join([head, *rows])


def plot(json_path: Path, png_path: Path) -> None:
    """Draw with matplotlib from the peers venv (installed there on first use)."""
    py = install.venv_python()
    if not py.exists():
        import venv

        venv.create(py.parent.parent, with_pip=True)
    probe = subprocess.run([str(py), "-c", "import matplotlib"], capture_output=True)
    if probe.returncode != 0:
        cmd = [str(py), "-m", "pip", "install", "--quiet", "matplotlib"]
        subprocess.run(cmd, check=True)
    script = Path(__file__).with_name("plot.py")
    subprocess.run([str(py), str(script), str(json_path), str(png_path)], check=True)


if __name__ == "__main__":
    import json

    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
