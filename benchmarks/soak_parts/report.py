"""The soak's JSON report: the checks (each a count that must be 0), the config, the oracle,
requests per protocol and outcome with latencies, the engine's counters and the processes'
growth; and `dumps`, JSON with what fits in 100 columns on one line."""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from dataclasses import asdict
from typing import Any

import numpy as np

from .load import Record, Soak
from .oracle import FAILURES, Oracle
from .resources import growth
from .run import Observed

ABORTED = "vllm:request_success_total{finished_reason=abort}"
FINISHED = [
    f"vllm:request_success_total{{finished_reason={r}}}" for r in ("stop", "length", "abort")
]


def report(args: argparse.Namespace, state: Soak, seen: Observed) -> dict[str, Any]:
    """The soak's JSON: `passed` when every count in `checks` is 0."""
    outcomes = state.outcomes()
    finished = sum(seen.after.get(k, 0) - seen.before.get(k, 0) for k in FINISHED)
    sent = sum(outcomes[o] for o in ("ok", "wrong_text", "cancelled", "disconnected"))
    restarted = sorted(
        name
        for name in seen.stub_pids[0].keys() | seen.stub_pids[1].keys()
        if seen.stub_pids[0].get(name) != seen.stub_pids[1].get(name)
    )
    checks = {
        "hung": outcomes["hung"],
        "lost": outcomes["lost"],
        "wrong_text": outcomes["wrong_text"] if state.oracle.check_text else 0,
        "unexpected_5xx": outcomes["unexpected_5xx"],
        "unexpected_error": outcomes["unexpected_error"],
        "kv_not_at_rest": int(seen.idle_s is None),
        "engine_finished_minus_requests_sent": round(finished - sent),
        "server_restarted": int(not seen.server_alive),
        "stubs_restarted": len(restarted),
    }
    midway = min(seen.samples, key=lambda s: abs(s["t_s"] - seen.load_s / 2))
    return {
        "passed": not any(checks.values()),
        "checks": checks,
        "config": config_section(args, seen),
        "oracle": oracle_section(args, state.oracle, seen),
        "load_s": round(seen.load_s, 1),
        "requests": requests_section(state.records, seen.load_s),
        "engine": engine_section(seen, outcomes, finished, sent),
        "processes": {
            "server_pid_unchanged": seen.server_alive,
            "stub_pids": seen.stub_pids[1],
            "stubs_restarted": restarted,
            **growth(seen.samples, midway),
        },
        "samples": [
            [s["t_s"], s["requests"], s["procs"]["server_and_stubs"]["rss_mib"]]
            for s in seen.samples
        ],
        "failures": [asdict(r) for r in state.records if r.outcome in FAILURES][:30],
    }


def oracle_section(args: argparse.Namespace, oracle: Oracle, seen: Observed) -> dict[str, Any]:
    texts = oracle.texts
    return {
        "seconds": round(seen.oracle_s, 1),
        "whole_equals_stream": sum(texts["whole", s] == texts["stream", s] for s in seen.specs),
        "text_check": "enforced" if oracle.check_text else f"not enforced ({args.dtype})",
    }


def config_section(args: argparse.Namespace, seen: Observed) -> dict[str, Any]:
    return {
        "model": args.model_name,
        "dtype": args.dtype,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "request_timeout_s": args.request_timeout,
        "specs": [[s.prompt[:40], s.max_tokens, list(s.stop)] for s in seen.specs],
        "server_log": str(seen.server_log),
    }


def requests_section(records: list[Record], load_s: float) -> dict[str, Any]:
    by_protocol: dict[str, Counter[str]] = defaultdict(Counter)
    latency: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_protocol[r.protocol][r.outcome] += 1
        if r.outcome == "ok":
            latency[r.protocol].append(r.seconds)
    bad = Counter(f"{r.protocol} {r.bad}: {r.outcome}" for r in records if r.bad)
    return {
        "total": len(records),
        "per_s": round(len(records) / load_s, 2),
        "by_outcome": dict(sorted(Counter(r.outcome for r in records).items())),
        "by_protocol": {p: dict(sorted(c.items())) for p, c in sorted(by_protocol.items())},
        "bad_requests": dict(sorted(bad.items())),
        "latency_ms_ok_p50_p90_max": {
            p: [percentile_ms(v, q) for q in (50, 90, 100)] for p, v in sorted(latency.items())
        },
    }


def engine_section(
    seen: Observed, outcomes: Counter[str], finished: float, sent: int
) -> dict[str, Any]:
    def delta(name: str) -> float:
        return round(seen.after.get(name, 0.0) - seen.before.get(name, 0.0), 3)

    rest = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    counters = sorted(k for k in seen.after if "_total" in k and delta(k))
    return {
        "aborted": delta(ABORTED),
        "cancels": outcomes["cancelled"],
        "http_disconnects_not_cancelled": outcomes["disconnected"],
        "finished": round(finished),
        "requests_sent_that_reach_it": sent,
        "at_rest_within_s": None if seen.idle_s is None else round(seen.idle_s, 2),
        "at_rest": {k.removeprefix("vllm:"): seen.after.get(k) for k in rest},
        "counters": {k.removeprefix("vllm:"): delta(k) for k in counters},
    }


def percentile_ms(values: list[float], q: float) -> int:
    return round(float(np.percentile(values, q)) * 1000)


def dumps(value: Any, indent: int = 0, width: int = 100) -> str:
    """JSON with every object or array that fits in `width` columns on one line."""
    flat = json.dumps(value, ensure_ascii=False)
    if len(flat) + indent <= width or not isinstance(value, dict | list) or not value:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 2, width)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps(v, indent + 2, width) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
