"""Bars of benchmarks/peers.json: run by the peers venv's python (matplotlib lives there).

python plot.py peers.json peers.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# each panel: the first of its candidates that the run measured (a cut of the configs)
PANELS = [
    [("decode, batch 1, context 128 (tok/s)", lambda r: _dec(r, 1, 128))],
    [
        ("decode, batch 32, context 1k (tok/s)", lambda r: _dec(r, 32, 1024)),
        ("decode, batch 32, context 128 (tok/s)", lambda r: _dec(r, 32, 128)),
    ],
    [
        ("prefill, 8 x 1k tokens (tok/s)", lambda r: _dec(r, 8, 1024, "prefill_tokens_per_s")),
        ("decode, batch 8, context 128 (tok/s)", lambda r: _dec(r, 8, 128)),
    ],
    [("48-request mix (output tok/s)", lambda r: r.get("mix", {}).get("output_tokens_per_s"))],
]
COLORS = {"pagedllm": "tab:blue", "llamacpp": "tab:orange", "hf": "tab:gray"}


def _dec(res, batch, ctx, key="tokens_per_s"):
    for d in res.get("decode", []):
        if d["batch"] == batch and d["context_tokens"] == ctx:
            return d.get(key)
    return None


def _measured(rep, get) -> bool:
    rows = [r for res in rep["results"].values() for r in res.values() if "decode" in r]
    return any(get(r) is not None for r in rows)


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rep = json.load(f)
    precisions = []
    for rows in rep["results"].values():
        precisions += [p for p in rows if p not in precisions]
    engines = list(rep["results"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.8 / len(engines)
    panels = [next((c for c in cands if _measured(rep, c[1])), cands[0]) for cands in PANELS]
    for ax, (title, get) in zip(axes.flat, panels, strict=True):
        for i, engine in enumerate(engines):
            rows = rep["results"][engine]
            xs, ys = [], []
            for j, p in enumerate(precisions):
                v = get(rows[p]) if p in rows and "decode" in rows[p] else None
                if v is not None:
                    xs.append(j + (i - (len(engines) - 1) / 2) * width)
                    ys.append(v)
            ax.bar(xs, ys, width, label=engine, color=COLORS.get(engine))
        ax.set_xticks(range(len(precisions)), precisions)
        ax.set_title(title)
    axes.flat[0].legend()
    m = rep["machine"]
    fig.suptitle(
        f"SmolLM2-135M on {m['cpu']}, {m['threads_used']} threads "
        f"(load avg at start {rep['loadavg_start'][0]}, {rep['started'][:10]})"
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
