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
Each level gets its own prompts of --prompt-len tokens made of random words: no two prompts
share a first KV block (16 tokens), so neither the server's prefix cache (which lives across
levels) nor the offline engine's gets hits; the offline run reports its hit count to show it.
One short request warms the server up before each level; one short generate warms each
offline engine up.

The client is kept light, since it shares the CPU with the server: all requests go over one
gRPC stream (Triton serves the requests of a stream concurrently; the report's
`max_streaming` shows it), input tensors are built before the clock starts, and the response
callback only records the arrival time and keeps the response; decoding happens afterwards.
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
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from client.stream import (
    DEFAULT_MODEL,
    ClientError,
    GenerationParams,
    connect,
    error_message,
    is_final,
    make_inputs,
    stream_generate,
    to_delta,
)

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
    "request (one response per engine step, i.e. per token); p50/p90 over all gaps",
    "tpot_ms": "per request: (last text response - first text response) / (tokens - 1); p50",
    "per_token_overhead_ms": "(1/served_tokens_per_s - 1/offline_tokens_per_s) * c * 1000. With "
    "c requests decoding together each engine step yields c tokens, so c/tokens_per_s is the "
    "time per step, i.e. per generated token of one request: this is how much longer that is "
    "when served than offline",
    "max_streaming": "the largest number of requests that had received their first response "
    "but not their final one at the same moment (c when the server interleaves them)",
}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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


def percentiles(values: Sequence[float], *qs: int) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": round(float(np.percentile(values, q)), 2) for q in qs}


# --- served -----------------------------------------------------------------------------------


@dataclass
class Trace:
    """One request as the client saw it."""

    sent: float = 0.0
    done: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each response with data
    results: list[Any] = field(default_factory=list)  # those responses, decoded after the run


class StreamRunner:
    """Sends prepared requests over one gRPC stream with at most `concurrency` in flight.
    The callback (the stream's response thread) does as little as possible: a clock read,
    two appends, and on the final response a semaphore release."""

    def __init__(self, client: grpcclient.InferenceServerClient, model: str) -> None:
        self.client = client
        self.model = model
        self.traces: list[Trace] = []
        self.error: str | None = None
        self.remaining = 0
        self.all_done = threading.Event()
        self.slots = threading.Semaphore(0)

    def _on_response(self, result: Any, error: Any) -> None:
        now = time.perf_counter()
        if error is not None:
            self.error = error_message(error)
            self.all_done.set()
            self.slots.release()
            return
        response = result.get_response()
        trace = self.traces[int(response.id)]
        if len(response.outputs):
            trace.times.append(now)
            trace.results.append(result)
        if is_final(result):
            trace.done = now
            self.remaining -= 1  # only this thread writes it
            self.slots.release()
            if self.remaining == 0:
                self.all_done.set()

    def run(self, requests: list[list[Any]], concurrency: int, timeout: float) -> list[Trace]:
        """Send `requests` (lists of input tensors); return their traces when all are done.
        Raises ClientError on the first error or after `timeout` seconds."""
        self.traces = [Trace() for _ in requests]
        self.remaining = len(requests)
        self.error = None
        self.all_done.clear()
        self.slots = threading.Semaphore(concurrency)
        deadline = time.monotonic() + timeout
        self.client.start_stream(callback=self._on_response)
        ok = False
        try:
            for i, inputs in enumerate(requests):
                while not self.slots.acquire(timeout=1.0):
                    self._check(deadline)
                self._check(deadline)
                self.traces[i].sent = time.perf_counter()
                self.client.async_stream_infer(
                    self.model, inputs, request_id=str(i), enable_empty_final_response=True
                )
            while not self.all_done.wait(timeout=1.0):
                self._check(deadline)
            self._check(deadline)
            ok = True
        finally:
            self.client.stop_stream(cancel_requests=not ok)
        return self.traces

    def _check(self, deadline: float) -> None:
        if self.error is not None:
            raise ClientError(self.error)
        if time.monotonic() > deadline:
            raise ClientError(f"timed out with {self.remaining} requests unfinished")


def summarize_served(traces: list[Trace], max_tokens: int) -> tuple[dict[str, Any], list[str]]:
    """Figures of one level and the served texts (decoded now, off the clock)."""
    start, end = min(t.sent for t in traces), max(t.done for t in traces)
    texts: list[str] = []
    counts, num_input = [], []
    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    complete = 0
    for t in traces:
        deltas = [to_delta(r) for r in t.results]
        indices = [int(r.as_numpy("index").reshape(-1)[0]) for r in t.results]
        last = deltas[-1] if deltas else None
        n = last.num_output_tokens if last else 0
        reasons = [d.finish_reason for d in deltas if d.finish_reason]
        texts.append("".join(d.text for d in deltas))
        counts.append(n)
        num_input.append(last.num_input_tokens if last else 0)
        if n == max_tokens and reasons == ["length"] and indices == list(range(len(deltas))):
            complete += 1
        if t.times:
            ttft.append((t.times[0] - t.sent) * 1e3)
            itl.extend(float(d) * 1e3 for d in np.diff(t.times))
            if n > 1:
                tpot.append((t.times[-1] - t.times[0]) / (n - 1) * 1e3)
    seconds = end - start
    output_tokens = sum(counts)
    return {
        "num_requests": len(traces),
        "seconds": round(seconds, 3),
        "output_tokens": output_tokens,
        "tokens_per_s": round(output_tokens / seconds, 2),
        "requests_complete": complete,
        "mean_prompt_tokens": round(float(np.mean(num_input)), 1),
        "responses_per_request": round(sum(len(t.results) for t in traces) / len(traces), 2),
        "ttft_ms": percentiles(ttft, 50, 90),
        "itl_ms": percentiles(itl, 50, 90),
        "tpot_ms": percentiles(tpot, 50),
        "max_streaming": max_streaming(traces),
    }, texts


def max_streaming(traces: list[Trace]) -> int:
    events = sorted(
        [(t.times[0], 1) for t in traces if t.times] + [(t.done, -1) for t in traces if t.times]
    )
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return peak


def run_served(
    url: str,
    model: str,
    levels: list[tuple[int, list[str]]],
    warmups: list[str],
    max_tokens: int,
    timeout: float,
) -> list[tuple[dict[str, Any], list[str]]]:
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    warm_params = GenerationParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    client = connect(url)
    out = []
    try:
        runner = StreamRunner(client, model)
        for (c, prompts), warm in zip(levels, warmups, strict=True):
            for _ in stream_generate(client, warm, warm_params, model=model, timeout=timeout):
                pass
            requests = [make_inputs(p, params) for p in prompts]
            log(f"served: concurrency {c}, {len(prompts)} requests")
            summary, texts = summarize_served(runner.run(requests, c, timeout), max_tokens)
            log(f"served: concurrency {c}: {summary['tokens_per_s']} tok/s")
            out.append((summary, texts))
    finally:
        client.close()
    return out


# --- offline ----------------------------------------------------------------------------------


def run_offline(
    model_dir: str, dtype: str, concurrency: int, prompts: list[str], warm: str, max_tokens: int
) -> tuple[dict[str, Any], list[str]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, max_num_seqs=concurrency)
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    hits = llm.engine.stats().prefix_cache_hits
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    summary = {
        "seconds": round(seconds, 3),
        "output_tokens": output_tokens,
        "tokens_per_s": round(output_tokens / seconds, 2),
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


def level_report(
    c: int, served: dict[str, Any], offline: dict[str, Any] | None, matches: int | None
) -> dict[str, Any]:
    served_tps = served["tokens_per_s"]
    offline_tps = offline["tokens_per_s"] if offline else None
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
            {k: r[k] for k in ("served_tokens_per_s", "offline_tokens_per_s", "ratio")}
            for r in rounds
        ]
    return report


@contextlib.contextmanager
def server_url(args: argparse.Namespace) -> Iterator[tuple[str, int | None]]:
    """(gRPC url, process group of a server started here, or None for --url)."""
    if args.url:
        yield args.url, None
        return
    from pagedllm.serving.launcher import make_server

    work = Path(args.work_dir) if args.work_dir else None
    server = make_server(args.model_dir, dtype=args.dtype, work_dir=work)
    log(f"starting tritonserver (log: {server.log_path}) ...")
    with server:
        assert server.process is not None
        yield server.grpc_url, server.process.pid  # its own process group, with the stubs
    log("tritonserver stopped")


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
    ap.add_argument("--no-offline", action="store_true", help="skip the offline engine")
    ap.add_argument("--rounds", type=int, default=1, help="repeat each level; median ratio")
    ap.add_argument("--work-dir", help="server logs and backend dir (default ~/.cache/pagedllm)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per level")
    ap.add_argument("--output", help="also write the JSON report here")
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1 or (args.num_requests is not None and args.num_requests < 1):
        ap.error("--concurrency and --num-requests must be positive")
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
        levels.append((c, make_prompts(tokenizer, n, args.prompt_len, seed=1000 * (k + 1))))
        warmups.append(make_prompts(tokenizer, 1, 8, seed=k)[0])

    results = []
    with server_url(args) as (url, pgid):
        for level, warm in zip(levels, warmups, strict=True):
            rounds = []
            for _ in range(args.rounds):
                c, prompts = level
                [(summary, texts)] = run_served(
                    url, args.model, [level], [warm], args.max_tokens, args.timeout
                )
                offline, matches = None, None
                if not args.no_offline:
                    with paused(pgid):
                        log(f"offline: concurrency {c}")
                        offline, offline_texts = run_offline(
                            args.model_dir, args.dtype, c, prompts, warm, args.max_tokens
                        )
                    matches = sum(a == b for a, b in zip(texts, offline_texts, strict=True))
                    log(f"offline: concurrency {c}: {offline['tokens_per_s']} tok/s")
                rounds.append(level_report(c, summary, offline, matches))
            results.append(median_round(rounds))

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
        },
        "workload": {
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "sampling": "greedy (temperature 0), ignore_eos: every request gives max_tokens",
            "prompts": "random words, distinct per request and per level: no shared KV block, "
            "no prefix-cache hits",
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
