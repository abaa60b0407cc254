"""The served half of `client.benchmark`: the prepared requests of one level sent over one gRPC
stream to the ensemble, and what the client saw of each (arrival times, responses), summed up.

The client shares the CPU with the server, so it is kept light: `tritonclient.grpc.aio` on one
event loop (the threaded client hands every response from gRPC's polling thread to its own
response thread: two wake-ups per response), input tensors built before the clock starts, and
per response only a clock read and two appends; decoding happens afterwards."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio

from client.stream import (
    ClientError,
    GenerationParams,
    connect,
    error_message,
    is_final,
    make_inputs,
    stream_generate,
    to_delta,
)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@dataclass
class Trace:
    """One request as the client saw it."""

    sent: float = 0.0
    done: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each response with data
    results: list[Any] = field(default_factory=list)  # those responses, decoded after the run


class StreamRunner:
    """Sends prepared requests over one gRPC stream with at most `concurrency` in flight."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model

    def run(self, requests: list[list[Any]], concurrency: int, timeout: float) -> list[Trace]:
        """Send `requests` (lists of input tensors); return their traces when all are done.
        Raises ClientError on the first error or after `timeout` seconds."""
        traces = [Trace() for _ in requests]
        left = [len(requests)]
        try:
            asyncio.run(asyncio.wait_for(self._run(requests, concurrency, traces, left), timeout))
        except asyncio.TimeoutError:
            raise ClientError(f"timed out with {left[0]} requests unfinished") from None
        return traces

    async def _run(
        self, requests: list[list[Any]], concurrency: int, traces: list[Trace], left: list[int]
    ) -> None:
        slots = asyncio.Semaphore(concurrency)

        async def send() -> AsyncIterator[dict[str, Any]]:
            for i, inputs in enumerate(requests):
                await slots.acquire()
                traces[i].sent = time.perf_counter()
                yield {
                    "model_name": self.model,
                    "inputs": inputs,
                    "request_id": str(i),
                    "enable_empty_final_response": True,
                }

        client = grpcaio.InferenceServerClient(self.url)
        try:
            async for result, error in client.stream_infer(send()):
                now = time.perf_counter()
                if error is not None:
                    raise ClientError(error_message(error))
                response = result.get_response()
                trace = traces[int(response.id)]
                if len(response.outputs):
                    trace.times.append(now)
                    trace.results.append(result)
                if is_final(result):
                    trace.done = now
                    left[0] -= 1
                    slots.release()
                    if left[0] == 0:
                        break
        finally:
            await client.close()


def percentiles(values: Sequence[float], *qs: int) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": round(float(np.percentile(values, q)), 2) for q in qs}


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
        runner = StreamRunner(url, model)
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
