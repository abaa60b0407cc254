"""Two replicas (`pagedllm serve` + `pagedllm openai` each, SmolLM2 on its GGUF weights) behind
a real cache-aware router (`smg`, docs/routing.md), all on this machine
(tests/router_cluster.py). Greedy answers through the router equal the same request sent to a
replica directly; requests sharing a prefix go to one replica, as the replicas' own prefix-cache
metrics show; and when a replica is killed mid-run every request either finishes exactly or
gets a clear error within a bounded time, and the router stops using the dead replica within
seconds. Where each request went is read from the replicas' own metrics
(`vllm:request_success_total`), never from the router's word."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil
import pytest
from router_cluster import MODEL, TIMEOUT, Cluster, Replica, completion, running_cluster

from pagedllm.device import torch_is_cpu_only
from pagedllm.prepare import prepare_smollm2
from pagedllm.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
# about 100 tokens each: 5 or 6 KV blocks of 16 tokens a replica can reuse
PREFIXES = {
    "garden": "You answer questions about gardening in one short sentence. " * 8,
    "ocean": "You are a tour guide on a ship and speak about the sea briefly. " * 8,
}


def served(r: Replica) -> float:
    """Requests this replica's engine has finished (any reason)."""
    return sum(v for k, v in r.metrics().items() if k.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("router")
    # killed at the end: a graceful stop takes 15 s more, and tests/test_drain.py covers it
    with running_cluster(log_dir, graceful=False) as c:
        pids = c.pids()
        yield c
    assert not [p for p in pids if running(p)], "processes left after the cluster stopped"


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_router_answers_exactly(cluster: Cluster) -> None:
    """Completions (streamed or not) and chat through the router equal the same requests sent
    straight to a replica's gateway; the router lists the replicas' model."""
    models = httpx.get(f"{cluster.router.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    direct = cluster.replicas[0].url
    for prompt in ("Once upon a time,", "The capital of France is"):
        expected = completion(direct, prompt, max_tokens=MAX_TOKENS)
        assert expected["status"] == 200 and expected["text"], expected
        for stream in (False, True):
            got = completion(cluster.router.url, prompt, stream, max_tokens=MAX_TOKENS)
            assert (got["text"], got["finish"], got["error"]) == (
                expected["text"],
                expected["finish"],
                None,
            )
    # the real model (its 4-bit weights: fp32 says " Nova Haven", these " New Haven", a near-tie)
    assert completion(direct, "Once upon a time,", max_tokens=MAX_TOKENS)["text"].startswith(
        " the city of"
    )
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    answers = [
        httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=TIMEOUT).json()
        for url in (direct, cluster.router.url)
    ]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    # a field the router forwards that the engine cannot honour: the gateway's clear 400
    refused = completion(cluster.router.url, "Hello", max_tokens=MAX_TOKENS, no_stop_trim=True)
    assert refused["status"] == 400 and "no_stop_trim" in refused["error"]


@pytest.mark.skipif(not torch_is_cpu_only(), reason="a CUDA torch build: serve asks it for a GPU")
def test_serve_and_the_gateway_hold_no_torch(cluster: Cluster) -> None:
    """`pagedllm serve` (the default model, device auto) only supervises tritonserver, and
    `pagedllm openai` only translates: with a CPU-only torch neither imports it, which each
    would hold (~150 MB) for as long as it runs."""
    for r in cluster.replicas:
        for proc in (r.serve, r.gateway):
            assert proc is not None
            maps = psutil.Process(proc.pid).memory_maps()
            assert maps and not [m.path for m in maps if "libtorch" in m.path], proc.args


def route_of(cluster: Cluster, prompt: str) -> int:
    """Send one request through the router; the index of the replica whose engine served it
    (its metrics are applied off the engine thread: they may lag the answer a little)."""
    before = [served(r) for r in cluster.replicas]
    result = completion(cluster.router.url, prompt, max_tokens=MAX_TOKENS)
    assert result["status"] == 200, result
    deadline = time.monotonic() + 5
    while not (grew := [i for i, r in enumerate(cluster.replicas) if served(r) > before[i]]):
        assert time.monotonic() < deadline, "no replica counted the request"
        time.sleep(0.05)
    assert len(grew) == 1, grew
    return grew[0]


def prefix_hits(r: Replica) -> float:
    return r.metrics().get("vllm:prefix_cache_hits_total", 0.0)  # there from the first hit


def test_cache_aware_keeps_a_prefix_on_one_replica(cluster: Cluster) -> None:
    """Three requests per prefix, interleaved: under `cache_aware` each prefix stays on one
    replica, whose prefix cache serves the prefix again; under `round_robin` (the negative
    control: the same check fails there) consecutive requests of a prefix alternate. (Which
    replica a new prefix goes to is smg's choice: the one whose tree has fewer nodes.)"""
    hits_before = [prefix_hits(r) for r in cluster.replicas]
    routes: dict[str, list[int]] = {name: [] for name in PREFIXES}
    for i in range(3):
        for name, prefix in PREFIXES.items():
            routes[name].append(route_of(cluster, f"{prefix}Question {i}: what now?"))
    assert all(len(set(r)) == 1 for r in routes.values()), routes
    # the later two requests of a prefix reuse its whole KV blocks (its last token may merge
    # with the text after it)
    tokenizer = Tokenizer.from_model_dir(prepare_smollm2())
    for name, prefix in PREFIXES.items():
        blocks = (len(tokenizer.encode(prefix)) - 1) // 16
        replica = routes[name][0]
        hits = prefix_hits(cluster.replicas[replica]) - hits_before[replica]
        assert hits >= 2 * blocks * 16, (name, replica, hits, blocks)
    cluster.restart_router("round_robin")
    try:
        spread = [route_of(cluster, f"{PREFIXES['ocean']}Question {i}: why?") for i in range(2)]
        assert set(spread) == {0, 1}, spread
    finally:
        cluster.restart_router("cache_aware")


def test_killing_a_replica_mid_run(cluster: Cluster) -> None:
    """Requests in flight on a replica that is killed, and requests sent while and after it
    dies: none hangs; each gets the exact answer (it was on the live replica, or the router
    retried it there) or a clear error (an HTTP error with a message, or a stream that had
    begun on the dead replica ending in an error event). The router marks the dead replica
    unhealthy within seconds, and every later request is served by the live one."""
    # counting: 48 tokens each, every one chosen by a wide margin (>= 2 nats offline), so the
    # answer does not depend on the batch it ran in; long enough to be streaming at the kill
    prompts = [
        f"{PREFIXES['garden']}Count from {10 * i} to {10 * i + 40}: {10 * i}, {10 * i + 1},"
        for i in range(8)
    ]
    victim = route_of(cluster, prompts[0])
    live, dead = cluster.replicas[1 - victim], cluster.replicas[victim]
    results: dict[int, dict[str, Any]] = {}
    starts: dict[int, float] = {}

    def send(i: int) -> None:
        starts[i] = time.monotonic()
        results[i] = completion(cluster.router.url, prompts[i], i % 2 == 1, max_tokens=48)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads[:4]:
        t.start()
    time.sleep(0.5)
    pids, killed_at = dead.pids(), time.monotonic()
    shm = dead.kill()
    assert not [p for p in pids if running(p)]
    assert len(shm) >= 7 and not [f for f in shm if os.path.exists(f)]  # one region per stub
    for t in threads[4:]:
        t.start()
    noticed = None
    while noticed is None and time.monotonic() - killed_at < 10:
        if cluster.router.healthy().get(dead.url) is False:
            noticed = time.monotonic() - killed_at
        time.sleep(0.1)
    for t in threads:
        t.join(TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert noticed is not None, "the router still counts the dead replica as healthy after 10 s"
    with ThreadPoolExecutor(4) as pool:
        answers = pool.map(lambda p: completion(live.url, p, max_tokens=48)["text"], prompts)
    expected = dict(enumerate(answers))
    in_flight = [i for i in range(4) if starts[i] + results[i]["seconds"] > killed_at]
    assert in_flight, results  # the kill did hit requests under way
    for i, r in results.items():
        assert r["seconds"] < TIMEOUT, (i, r)
        if r["error"] is None:
            assert (r["status"], r["text"]) == (200, expected[i]), (i, r)
        else:
            assert i in in_flight and r["status"] in (200, 500, 502, 503), (i, r)
    # sent after the kill: retried on the live replica if the router tried the dead one first
    assert all(results[i]["error"] is None for i in range(4, 8)), results
    before = served(live)
    for i in range(3):
        assert completion(cluster.router.url, prompts[i], max_tokens=48)["text"] == expected[i]
    deadline = time.monotonic() + 5
    while served(live) - before < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served(live) - before == 3
