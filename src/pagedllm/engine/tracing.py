"""Request lifecycle tracing: every request's transitions (queued, scheduled, each prefill
chunk, first token, preempted, resumed, finished with its reason — `abort` when cancelled)
and every engine step, as one JSON object per line. Off unless a file is given.
`chrome_trace` turns such a file into a Chrome / Perfetto trace (one track per request, one
for the engine's steps): `pagedllm trace EVENTS.jsonl -o trace.json`, then open it in
https://ui.perfetto.dev or chrome://tracing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.scheduler import SchedulerOutput
    from pagedllm.request import Request


class Tracer:
    """Appends events to a JSON-lines file; `ts` is seconds on the monotonic clock."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def event(self, name: str, request_id: str | None = None, **fields: Any) -> None:
        record: dict[str, Any] = {"ts": round(time.monotonic(), 6), "event": name}
        if request_id is not None:
            record["request_id"] = request_id
        record.update(fields)
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()

    def scheduled(self, sched: SchedulerOutput) -> None:
        """A step's preemptions, first admissions and resumptions."""
        for request_id in sched.preempted_ids:
            self.event("preempted", request_id)
        for request in sched.admitted:
            self.event("scheduled", request.request_id, cached=request.num_cached_tokens)
        for request_id in sched.resumed_ids:
            self.event("resumed", request_id)

    def step(self, sched: SchedulerOutput, changed: list[Request], duration: float) -> None:
        """A step's prefill chunks, first tokens, and the step itself."""
        prefill_tokens = 0
        for s in sched.scheduled:
            if s.start_pos < len(s.prompt_token_ids):  # a prompt chunk (or its recompute)
                prefill_tokens += s.num_tokens
                self.event(
                    "prefill_chunk",
                    s.request_id,
                    start=s.start_pos,
                    tokens=s.num_tokens,
                    duration=round(duration, 6),
                )
        for request in changed:
            if request.num_output_tokens == 1:
                self.event("first_token", request.request_id)
        self.event(
            "step",
            duration=round(duration, 6),
            requests=len(sched.scheduled),
            prefill_tokens=prefill_tokens,
            decode_tokens=sched.num_tokens - prefill_tokens,
        )


def read_events(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chrome_trace(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace-event JSON: the engine's steps on one track (pid 1), and one track per
    request (pid 2): spans `queued` (arrival → first scheduled), `prefill` (each chunk's step),
    `decode` (first token → finish), and instants for the other transitions."""
    events = sorted(events, key=lambda e: e["ts"])
    if not events:
        return {"traceEvents": []}
    t0 = events[0]["ts"]

    def us(ts: float) -> float:
        return round((ts - t0) * 1e6, 1)

    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "engine"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "requests"}},
    ]
    tids: dict[str, int] = {}
    open_span: dict[str, tuple[str, float]] = {}  # request -> (span name, start ts)

    def track(request_id: str) -> int:
        if request_id not in tids:
            tids[request_id] = len(tids) + 1
            out.append(
                {
                    "ph": "M",
                    "pid": 2,
                    "tid": tids[request_id],
                    "name": "thread_name",
                    "args": {"name": request_id},
                }
            )
        return tids[request_id]

    def span(
        request_id: str, name: str, begin: float, end: float, args: dict[str, Any] | None = None
    ) -> None:
        out.append(
            {
                "ph": "X",
                "pid": 2,
                "tid": track(request_id),
                "name": name,
                "ts": us(begin),
                "dur": max(round(us(end) - us(begin), 1), 0.1),
                "args": args or {},
            }
        )

    for e in events:
        name, ts, rid = e["event"], e["ts"], e.get("request_id")
        args = {k: v for k, v in e.items() if k not in ("event", "ts", "request_id")}
        if name == "step":
            out.append(
                {
                    "ph": "X",
                    "pid": 1,
                    "tid": 0,
                    "name": "step",
                    "ts": us(ts - e["duration"]),
                    "dur": round(e["duration"] * 1e6, 1),
                    "args": args,
                }
            )
            continue
        if rid is None:
            continue
        track(rid)
        if name == "queued":
            open_span[rid] = ("queued", ts)
        elif name in ("scheduled", "resumed") and rid in open_span:
            span_name, start = open_span.pop(rid)
            span(rid, span_name, start, ts)
        elif name == "prefill_chunk":
            span(rid, "prefill", ts - e.get("duration", 0.0), ts, args)
        elif name == "first_token":
            open_span[rid] = ("decode", ts)
        elif name == "preempted":
            if rid in open_span:
                span_name, start = open_span.pop(rid)
                span(rid, span_name, start, ts)
            open_span[rid] = ("waiting (preempted)", ts)
        elif name == "finished" and rid in open_span:
            span_name, start = open_span.pop(rid)
            span(rid, span_name, start, ts)
        if name not in ("prefill_chunk",):
            out.append(
                {
                    "ph": "i",
                    "s": "t",
                    "pid": 2,
                    "tid": tids[rid],
                    "name": name,
                    "ts": us(ts),
                    "args": args,
                }
            )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="pagedllm trace", description="JSON-lines lifecycle events -> Chrome trace JSON"
    )
    parser.add_argument("events", help="the file the engine traced to (PAGEDLLM_TRACE_FILE)")
    parser.add_argument("-o", "--output", default="trace.json")
    args = parser.parse_args(argv)
    trace = chrome_trace(read_events(args.events))
    Path(args.output).write_text(json.dumps(trace), encoding="utf-8")
    print(f"{args.output}: open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
