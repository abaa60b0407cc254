"""Batch-1 decode of ours and llama.cpp in alternating rounds: each round measures the memory
bandwidth, then llama-batched-bench, then our engine, each in a fresh process, so that this
machine's drift (tens of % from minute to minute on a shared 2-vCPU host) hits both engines
and the bandwidth alike. The ratio of each round's pair, and their median, is the comparison
the targets are read from; the parts' own batch-1 rows are single sequential samples. The
mix against HF static batching likewise (`mix_rounds`): ours, then HF, in turn."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from peers_parts import common, hf, install, llamacpp, ours
from peers_parts.common import Budget


def llama_step(shipped: Path, precision: str, budget: Budget) -> tuple[float, int]:
    """llama.cpp's batch-1 step (ms) at the budget's first decode config, and the bytes of
    weights one step reads."""
    bins = install.ensure_llama_cpp()
    model = llamacpp.gguf_for(precision, bins, shipped)
    one = dataclasses.replace(budget, decode_configs=budget.decode_configs[:1])
    return llamacpp.batched_bench(bins, model, one)[0]["step_ms"], llamacpp.gguf_info(model)[
        "weight_bytes"
    ]


def ours_step(model: str, precision: str, budget: Budget) -> tuple[float, int]:
    batch, ctx = budget.decode_configs[0]
    row = ours.decode(model, precision, batch, ctx, budget.decode_steps)
    return row["step_ms"], row["weight_bytes"]


def run(
    isolated: Any,
    model: str,
    shipped: Path,
    precisions: list[str],
    budget: Budget,
    rounds: int,
    model_cfg: dict[str, Any],
) -> dict[str, Any]:
    """{precision: {"rounds": [...], medians}} for each precision both engines run."""
    batch, ctx = budget.decode_configs[0]
    assert batch == 1, "the paired rounds compare batch-1 decode"
    mid = ctx + budget.decode_steps / 2  # the KV a step reads, on average
    out: dict[str, Any] = {}
    for precision in precisions:
        if precision not in llamacpp.TYPES:
            continue
        kv = {
            "llamacpp": common.kv_bytes_per_token(model_cfg, common.KV_BYTES["f16"]),
            "pagedllm": common.kv_bytes_per_token(
                model_cfg, common.KV_BYTES["bfloat16" if precision == "bf16" else "float32"]
            ),
        }
        rows = []
        for _ in range(rounds):
            row: dict[str, Any] = {"loadavg_before": common.loadavg()}
            bw = isolated(common.memory_bandwidth_gbs)
            row["bandwidth_gbs"] = round(bw, 2)
            for engine, step in (("llamacpp", llama_step), ("pagedllm", ours_step)):
                src = shipped if engine == "llamacpp" else model
                ms, weights = isolated(step, src, precision, budget)
                use = common.bandwidth_use(weights, kv[engine], mid, ms / 1e3, bw)
                row[engine] = {"step_ms": ms, "tokens_per_s": round(1e3 / ms, 1), **use}
            row["ratio"] = round(row["llamacpp"]["step_ms"] / row["pagedllm"]["step_ms"], 3)
            rows.append(row)
        out[precision] = {
            "rounds": rows,
            "ratio_median": round(statistics.median(r["ratio"] for r in rows), 3),
            "pagedllm_fraction_median": round(
                statistics.median(r["pagedllm"]["fraction_of_bandwidth"] for r in rows), 3
            ),
            "llamacpp_fraction_median": round(
                statistics.median(r["llamacpp"]["fraction_of_bandwidth"] for r in rows), 3
            ),
        }
    return out


def ours_mix(model: str, precision: str, budget: Budget) -> float:
    import torch

    torch.set_num_threads(common.THREADS)
    return float(ours.mix(model, precision, budget)["output_tokens_per_s"])


def hf_mix(model: str, precision: str, budget: Budget) -> float:
    import torch

    torch.set_num_threads(common.THREADS)
    torch.manual_seed(0)
    return float(hf.mix(hf.load(model, precision), budget)["output_tokens_per_s"])


def mix_rounds(
    isolated: Any, model: str, precisions: list[str], budget: Budget, rounds: int
) -> dict[str, Any]:
    """{precision: {"rounds": [...], "ratio_median"}}: the mix's tok/s, ours then HF static,
    in alternating rounds (HF runs fp32 and bf16)."""
    out: dict[str, Any] = {}
    for precision in (p for p in precisions if p in hf.DTYPES):
        rows = []
        for _ in range(rounds):
            row: dict[str, Any] = {"loadavg_before": common.loadavg()}
            row["pagedllm"] = round(isolated(ours_mix, model, precision, budget), 1)
            row["hf"] = round(isolated(hf_mix, model, precision, budget), 1)
            row["ratio"] = round(row["pagedllm"] / row["hf"], 3)
            rows.append(row)
        out[precision] = {
            "rounds": rows,
            "ratio_median": round(statistics.median(r["ratio"] for r in rows), 3),
        }
    return out


def _each(r: dict[str, Any], key: str) -> str:
    """One figure of every round, comma-separated."""
    return ", ".join(f"{x[key]:g}" for x in r["rounds"])


def markdown(paired: dict[str, Any]) -> str:
    head = (
        "| precision | rounds | ours ÷ llama.cpp, each round | median "
        "| ours, fraction of bandwidth | llama.cpp, fraction |\n|---|---:|---|---:|---:|---:|"
    )
    rows = [
        f"| {p} | {len(r['rounds'])} | {_each(r, 'ratio')} | {r['ratio_median']:g} "
        f"| {r['pagedllm_fraction_median']:g} | {r['llamacpp_fraction_median']:g} |"
        for p, r in paired.items()
    ]
    return "\n".join([head, *rows])


def mix_markdown(paired: dict[str, Any]) -> str:
    head = (
        "| precision | ours tok/s, each round | HF static tok/s | ours ÷ HF, each round | median |"
        "\n|---|---|---|---|---:|"
    )
    rows = [
        f"| {p} | {_each(r, 'pagedllm')} | {_each(r, 'hf')} | {_each(r, 'ratio')} "
        f"| {r['ratio_median']:g} |"
        for p, r in paired.items()
    ]
    return "\n".join([head, *rows])
