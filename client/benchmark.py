"""Served vs offline throughput: the `ensemble` over gRPC streaming, then the offline engine
on the same prompts, at each concurrency; one JSON document on stdout (and in --output).

    python -m client.benchmark [--model-dir DIR] [--concurrency 1 8 32] [--max-tokens 64]
    python -m client.benchmark --url localhost:8001 --model-dir DIR   # a server already running

Without --url the benchmark starts tritonserver itself (`pagedllm.serving.launcher`) and, level
by level, measures the served run, then pauses the server (SIGSTOP to its process group: it
uses no CPU) and runs the offline engine (`pagedllm.LLM(model_dir, dtype=..., max_num_seqs=c)`)
on the same prompts, then resumes the server: the two never share the CPU, and the two runs of
a level are a minute apart, so a machine whose speed drifts affects both alike. `--rounds R`
repeats every level R times and reports the median ratio.

Workload per level: N requests (--num-requests, default 4 x concurrency and at least 8), at
most c in flight, greedy, ignore_eos, so every request produces exactly --max-tokens tokens.
Each level, and each round of it, gets its own prompts of --prompt-len tokens made of random
words: no two prompts share a first KV block (16 tokens), so neither the server's prefix
cache (which lives across levels and rounds) nor the offline engine's gets hits; both runs
report their hit counts to show it (the served one from the metrics of a server started here).
One short request warms the server up before each level; one short generate warms each
offline engine up.

All requests of a level go over one gRPC stream (Triton serves the requests of a stream
concurrently; the report's `max_streaming` shows it), sent by a light asyncio client
(`client/served.py`). `--stream-interval K` starts the server with `stream_interval` K (one
response per K tokens, the first at once; docs/serving.md); with --url the server's own
setting holds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from client import cpu
from client.served import log, run_served
from client.stream import DEFAULT_MODEL, ClientError
from pagedllm.serving.metrics import scrape

REPO_ROOT = Path(__file__).resolve().parents[1]
WORDS = (  # noqa: SIM905
    "time river light stone garden window morning silver paper engine market winter forest "
    "signal harbor letter mountain bridge candle violet thunder orchard lantern meadow canyon "
    "pocket ribbon castle feather compass marble needle planet rocket saddle tunnel velvet "
    "whistle anchor basket cabinet dragon ember falcon glacier hammer island jacket kettle "
    "ladder mirror nectar oyster pepper quartz radish spiral tablet umbrella valley walnut "
    "yellow zephyr quickly slowly gently bravely calmly eagerly softly boldly kindly warmly "
    "ran jumped sang wrote built opened carried painted followed counted remembered "
    "blue green red small large ancient modern quiet loud bright dark"
).split()

DEFINITIONS = {
    "served_tokens_per_s": "output tokens of the N requests / wall time from sending the first "
    "request to the last final response; at most c requests in flight on one gRPC stream to "
    "the ensemble (tokenizer -> llm_engine -> detokenizer)",
    "offline_tokens_per_s": "the same prompts and sampling parameters through "
    "pagedllm.LLM(model_dir, dtype, max_num_seqs=c).generate: output tokens / its wall time",
    "ratio": "served_tokens_per_s / offline_tokens_per_s",
    "ttft_ms": "per request: request sent -> first response carrying text; p50/p90 over the "
    "N requests",
    "itl_ms": "inter-token latency: gaps between consecutive responses carrying text of one "
    "request (one response per engine step, i.e. per token; per stream_interval tokens when "
    "that is > 1); p50/p90 over all gaps",
    "tpot_ms": "per request: (last text response - first text response) / (tokens - 1); p50",
    "per_token_overhead_ms": "(1/served_tokens_per_s - 1/offline_tokens_per_s) * c * 1000. With "
    "c requests decoding together each engine step yields c tokens, so c/tokens_per_s is the "
    "time per step, i.e. per generated token of one request: this is how much longer that is "
    "when served than offline",
    "serving_cpu_s": "CPU seconds of the served run outside the llm_engine stub: tritonserver, "
    "the other models' stubs and this client (client/cpu.py; a server started here only)",
    "max_streaming": "the largest number of requests that had received their first response "
    "but not their final one at the same moment (c when the server interleaves them)",
}


# --- workload ---------------------------------------------------------------------------------


def make_prompts(tokenizer: Any, n: int, prompt_len: int, seed: int) -> list[str]:
    """`n` prompts of random words, each `prompt_len` tokens or just over (the tokenizer's
    count, special tokens included)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        words = [rng.choice(WORDS).capitalize()]
        while len(tokenizer.encode(" ".join(words))) < prompt_len:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words))
    return prompts


# --- offline ----------------------------------------------------------------------------------


def run_offline(
    model_dir: str, dtype: str, concurrency: int, prompts: list[str], warm: str, max_tokens: int
) -> tuple[dict[str, Any], list[str]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, max_num_seqs=concurrency)
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    hits = llm.engine.stats().prefix_cache_hits
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start, cpu_start = time.perf_counter(), cpu.own_cpu()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    cpu_s = cpu.own_cpu() - cpu_start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    summary = {
        "seconds": round(seconds, 3),
        "output_tokens": output_tokens,
        "tokens_per_s": round(output_tokens / seconds, 2),
        "cpu_s": round(cpu_s, 4),  # a tiny run can cost under 5 ms
        "prefix_cache_hit_tokens": llm.engine.stats().prefix_cache_hits - hits,
        "dtype": str(llm.engine.config.dtype).removeprefix("torch."),
    }
    texts = [o.outputs[0].text for o in outs]
    del llm, outs
    gc.collect()
    return summary, texts


# --- report -----------------------------------------------------------------------------------


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),  # the offline engine's
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),  # a server started here has it
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


HITS = "served_prefix_cache_hit_tokens"  # each round's: 0 unless the rounds shared prompts


def level_report(
    c: int, served: dict[str, Any], offline: dict[str, Any] | None, matches: int | None
) -> dict[str, Any]:
    served_tps = served["tokens_per_s"]
    offline_tps = offline["tokens_per_s"] if offline else None
    serving = None
    if "cpu_s" in served:
        serving = round(sum(v for k, v in served["cpu_s"].items() if k != "stub:llm_engine"), 2)
    return {
        "concurrency": c,
        "served_tokens_per_s": served_tps,
        "offline_tokens_per_s": offline_tps,
        "ratio": round(served_tps / offline_tps, 3) if offline_tps else None,
        "ttft_ms": served["ttft_ms"],
        "itl_ms": served["itl_ms"],
        "tpot_ms": served["tpot_ms"],
        "per_token_overhead_ms": (
            round((1 / served_tps - 1 / offline_tps) * c * 1000, 2) if offline_tps else None
        ),
        "serving_cpu_s": serving,
        "serving_cpu_ms_per_token": (
            round(serving / served["output_tokens"] * 1000, 3) if serving is not None else None
        ),
        HITS: served.get("prefix_cache_hit_tokens"),
        "served_texts_equal_offline": matches,
        "served": served,
        "offline": offline,
    }


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median ratio (the served one's if there is no offline run), with
    every round's ratio alongside."""
    key = "ratio" if rounds[0]["ratio"] is not None else "served_tokens_per_s"
    ordered = sorted(rounds, key=lambda r: r[key])
    report = dict(ordered[(len(ordered) - 1) // 2])
    if len(rounds) > 1:
        report["rounds"] = [
            {k: r[k] for k in ("served_tokens_per_s", "offline_tokens_per_s", "ratio", HITS)}
            for r in rounds
        ]
    return report


@contextlib.contextmanager
def server_url(args: argparse.Namespace) -> Iterator[tuple[str, int | None, str | None]]:
    """(gRPC url, process group and metrics url of a server started here: None, None for
    --url)."""
    if args.url:
        yield args.url, None, None
        return
    from pagedllm.serving.launcher import make_server

    work = Path(args.work_dir) if args.work_dir else None
    env = {"PAGEDLLM_STREAM_INTERVAL": str(args.stream_interval)} if args.stream_interval else None
    server = make_server(args.model_dir, dtype=args.dtype, work_dir=work, env=env)
    log(f"starting tritonserver (log: {server.log_path}) ...")
    with server:
        assert server.process is not None
        # its own process group, with the stubs
        yield server.grpc_url, server.process.pid, server.metrics_url
    log("tritonserver stopped")


def prefix_cache_hits(metrics_url: str | None) -> int | None:
    """The server's prompt tokens found in its prefix cache so far (None: no metrics url)."""
    if metrics_url is None:
        return None
    return int(scrape(metrics_url).get("vllm:prefix_cache_hits_total", 0))


@contextlib.contextmanager
def paused(pgid: int | None) -> Iterator[None]:
    """The server (and its stubs) stopped meanwhile, so that it uses no CPU."""
    if pgid is not None:
        os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pgid is not None:
            os.killpg(pgid, signal.SIGCONT)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m client.benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-dir", help="HF model directory (default: the prepared SmolLM2)")
    ap.add_argument("--url", help="gRPC host:port of a running server (default: start one)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="Triton model (default %(default)s)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, help="per level (default 4 x c, at least 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--dtype", default="auto", help="server and offline engine (default auto)")
    ap.add_argument(
        "--torch-threads",
        type=int,
        help="threads of the engines (OMP_NUM_THREADS of a server started here, "
        "torch.set_num_threads offline; default: torch's, one per core)",
    )
    ap.add_argument(
        "--stream-interval",
        type=int,
        help="a server started here sends one response per this many tokens (default: its "
        "config's, 1)",
    )
    ap.add_argument("--no-offline", action="store_true", help="skip the offline engine")
    ap.add_argument("--rounds", type=int, default=1, help="repeat each level; median ratio")
    ap.add_argument("--work-dir", help="server logs and backend dir (default ~/.cache/pagedllm)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per level")
    ap.add_argument("--output", help="also write the JSON report here")
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1 or (args.num_requests is not None and args.num_requests < 1):
        ap.error("--concurrency and --num-requests must be positive")
    if args.stream_interval is not None and (args.stream_interval < 1 or args.url):
        ap.error("--stream-interval must be positive, and sets a server started here")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.text.tokenizer import Tokenizer

    if args.model_dir is None:
        from pagedllm.prepare import prepare_smollm2

        args.model_dir = str(prepare_smollm2())
    if args.torch_threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # the server inherits it
        torch.set_num_threads(args.torch_threads)
    tokenizer = Tokenizer.from_model_dir(args.model_dir)
    levels, warmups = [], []
    for k, c in enumerate(args.concurrency):
        n = args.num_requests or max(4 * c, 8)
        # each round its own prompts: a round must not hit the prefix cache the server kept
        # from the one before (the offline engine starts empty every round)
        rounds = [
            make_prompts(tokenizer, n, args.prompt_len, 1000 * (k + 1) + r)
            for r in range(args.rounds)
        ]
        levels.append((c, rounds))
        warmups.append(make_prompts(tokenizer, 1, 8, seed=k)[0])

    results = []
    with server_url(args) as (url, pgid, metrics_url):
        for (c, prompt_sets), warm in zip(levels, warmups, strict=True):
            reports = []
            for prompts in prompt_sets:
                before = (cpu.group_cpu(pgid), cpu.own_cpu()) if pgid is not None else None
                hits = prefix_cache_hits(metrics_url)
                [(summary, texts)] = run_served(
                    url, args.model, [(c, prompts)], [warm], args.max_tokens, args.timeout
                )
                if before is not None and pgid is not None:
                    summary["cpu_s"] = cpu.spent(before[0], cpu.group_cpu(pgid))
                    summary["cpu_s"]["client"] = round(cpu.own_cpu() - before[1], 2)
                if hits is not None:
                    time.sleep(0.5)  # the engine's last stats reach the metrics a bit later
                    summary["prefix_cache_hit_tokens"] = (
                        prefix_cache_hits(metrics_url) or 0
                    ) - hits
                offline, matches = None, None
                if not args.no_offline:
                    with paused(pgid):
                        log(f"offline: concurrency {c}")
                        offline, offline_texts = run_offline(
                            args.model_dir, args.dtype, c, prompts, warm, args.max_tokens
                        )
                    matches = sum(a == b for a, b in zip(texts, offline_texts, strict=True))
                    log(f"offline: concurrency {c}: {offline['tokens_per_s']} tok/s")
                reports.append(level_report(c, summary, offline, matches))
            results.append(median_round(reports))

    return {
        "model_dir": args.model_dir,
        "triton_model": args.model,
        "dtype": args.dtype,
        "git": git_commit(),
        "machine": machine_info(),
        "server": {
            "url": url,
            "started_by_benchmark": pgid is not None,
            "paused_during_offline": pgid is not None,
            "stream_interval": args.stream_interval or (None if args.url else 1),
        },
        "workload": {
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "sampling": "greedy (temperature 0), ignore_eos: every request gives max_tokens",
            "prompts": "random words, distinct per request, per level and per round: no shared "
            "KV block, no prefix-cache hits",
        },
        "definitions": DEFINITIONS,
        "results": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
