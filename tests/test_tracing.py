"""Request-lifecycle tracing and the preemption counter on a real tritonserver whose KV pool
is too small for its load: every request's transitions are in the trace file, a forced
preemption is counted and traced, and the file becomes a valid Chrome trace with one track
per request."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import GrpcStream, metrics, wait_idle

from pagedllm.engine.tracing import chrome_trace, main, read_events
from pagedllm.serving.launcher import make_server
from pagedllm.serving.tritonserver import TritonServer

# the tiny llama's KV: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB
# per block: ~24 blocks, room for ~3 of the 6 requests below at their full length
KV_GIB = 24 * 8192 / (1 << 30)


@pytest.fixture(scope="module")
def traced(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TritonServer, Path]]:
    work = tmp_path_factory.mktemp("triton-traced")
    trace_file = work / "events.jsonl"
    env = {"PAGEDLLM_TRACE_FILE": str(trace_file), "PAGEDLLM_KV_CACHE_MEMORY_GIB": str(KV_GIB)}
    with make_server(str(checkpoints["llama"]), dtype="float32", work_dir=work, env=env) as s:
        yield s, trace_file


def test_preemption_is_counted_and_traced(
    traced: tuple[TritonServer, Path], tmp_path: Path
) -> None:
    server, trace_file = traced
    streams = [
        GrpcStream(
            server,
            {
                "text_input": f"Story {i}:",
                "max_tokens": 100,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )
        for i in range(6)
    ]
    for stream in streams:
        stream.wait()
        assert stream.responses[-1][1]["num_output_tokens"] == 100
    wait_idle(server, timeout=5)
    m = metrics(server)
    assert m["vllm:num_preemptions_total"] > 0

    events = read_events(trace_file)
    by_request = defaultdict(list)
    for e in events:
        if "request_id" in e:
            by_request[e["request_id"]].append(e["event"])
    assert len(by_request) == 6
    for names in by_request.values():
        assert names[:2] == ["queued", "scheduled"]
        assert "prefill_chunk" in names and "first_token" in names
        assert names[-1] == "finished"
    preempted = [names for names in by_request.values() if "preempted" in names]
    assert len(preempted) > 0 and all("resumed" in names for names in preempted)
    assert (
        sum(names.count("preempted") for names in by_request.values())
        == (m["vllm:num_preemptions_total"])
    )
    assert all(e["reason"] == "length" for e in events if e["event"] == "finished")
    steps = [e for e in events if e["event"] == "step"]
    assert sum(e["decode_tokens"] for e in steps) >= 6 * 99

    out = tmp_path / "trace.json"
    assert main([str(trace_file), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert trace == chrome_trace(events)
    tracks = [e for e in trace["traceEvents"] if e.get("name") == "thread_name"]
    assert sorted(e["args"]["name"] for e in tracks) == sorted(by_request)
    for e in trace["traceEvents"]:
        assert e["ph"] in ("M", "X", "i")
        if e["ph"] != "M":
            assert e["ts"] >= 0 and e.get("dur", 0) >= 0
    spans = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"step", "queued", "prefill", "decode", "waiting (preempted)"} <= spans
