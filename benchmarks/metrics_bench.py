"""Overhead of metrics and tracing on decode throughput (issue: ≤ 3 % with metrics on and
tracing off). Runs the same batch of greedy requests through `LLMEngine` three ways —
metrics off, metrics on (recorded by the engine and turned into Prometheus updates every step,
as the `llm_engine` model's stats callback does), metrics on + tracing to a file — repeated
in rotation so that drift hits every mode alike, and prints JSON.

    .venv/bin/python benchmarks/metrics_bench.py [--model-dir DIR] [--batch 32] [--rounds 3]

Not measured here: the Python backend's IPC for each metric update (one message per changed
metric per step, done on the engine thread in the server).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.prepare import prepare_smollm2
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.serving.metrics import MetricsExporter

MODES = ("metrics_off", "metrics_on", "metrics_and_tracing")


def run(config: EngineConfig, mode: str, batch: int, max_tokens: int, trace_dir: Path) -> float:
    """Output tokens per second of the decode steps (after every request's first token)."""
    engine = LLMEngine(
        config,
        metrics=mode != "metrics_off",
        trace_file=str(trace_dir / f"{mode}.jsonl") if mode == "metrics_and_tracing" else None,
    )
    exporter = MetricsExporter() if engine.metrics is not None else None
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    for i in range(batch):
        engine.add_request(
            f"r{i}", f"Request {i}: tell me a long story about paged memory.", params
        )
    tokens, start = 0, None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if exporter is not None:
            assert engine.metrics is not None
            for _ in exporter.updates(engine.stats(), engine.metrics.drain()):
                pass
        if start is None:
            if all(r.num_output_tokens for r in engine.scheduler.running):
                start = time.perf_counter()
            continue
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    assert start is not None
    elapsed = time.perf_counter() - start
    engine.close()
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model_dir = args.model_dir or str(prepare_smollm2())
    config = EngineConfig.create(model_dir, dtype=args.dtype, max_num_seqs=args.batch)
    results: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        run(config, "metrics_off", 4, 4, Path(tmp))  # warm-up (kernels, caches)
        for _ in range(args.rounds):
            for mode in MODES:
                results[mode].append(run(config, mode, args.batch, args.max_tokens, Path(tmp)))
    median = {m: statistics.median(v) for m, v in results.items()}
    base = median["metrics_off"]
    print(
        json.dumps(
            {
                "model_dir": model_dir,
                "dtype": args.dtype,
                "batch": args.batch,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "torch_threads": torch.get_num_threads(),
                "decode_tokens_per_s": {m: [round(x, 2) for x in v] for m, v in results.items()},
                "median_tokens_per_s": {m: round(v, 2) for m, v in median.items()},
                "overhead_vs_metrics_off": {
                    m: round(1 - median[m] / base, 4) for m in MODES if m != "metrics_off"
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
