"""Cache-aware vs round-robin routing over two replicas, and a replica killed mid-run
(docs/routing.md). Starts two replicas (`pagedllm serve` + `pagedllm openai`, SmolLM2 on its
GGUF weights) and the `smg` router (tests/router_cluster.py), then:

1. runs a workload of streamed greedy requests in groups sharing a long prefix, sent in an
   interleaved order by a few concurrent clients, under `cache_aware` and under `round_robin`
   (the router restarted with the other policy), alternating, `--rounds` times each. Each run
   has prefixes of its own (random words from its own seed), so no run finds another's
   prefixes in the replicas' caches: as fresh replicas, without their start-up time. Prefix-
   cache hit rate (`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`) and mean
   TTFT (`vllm:time_to_first_token_seconds` sum / count) come from the replicas' own metrics,
   summed over both; the client's mean TTFT is shown beside them;
2. checks every answer against the offline engine (`pagedllm.LLM`, the same GGUF weights) on
   the same prompts;
3. runs the workload once more (cache-aware) and kills the replica that serves most of it
   mid-run: counts the requests that finished exactly, ended in a clear error, gave a wrong
   text without an error (must be 0) or hung (must be 0), and how long the router took to
   mark the dead replica unhealthy.

Prints JSON and writes it to --out (default benchmarks/router-bench.json).

    .venv/bin/python benchmarks/router_bench.py [--rounds 2] [--groups 4] [--per-group 8]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))
from router_cluster import TIMEOUT, Cluster, completion, running_cluster  # noqa: E402
from router_oracle import Answer, judge, offline_answers  # noqa: E402

# fmt: off
WORDS = [
    "river", "mountain", "lantern", "harbor", "copper", "meadow", "violet", "engine", "orchard",
    "signal", "canyon", "pepper", "glacier", "marble", "thunder", "saddle", "compass", "ribbon",
    "falcon", "tunnel", "velvet", "quarry", "beacon", "walnut", "anchor", "summit", "cobalt",
    "prairie", "ember", "lagoon",
]
# fmt: on
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
TTFT = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")


def workload(seed: int, groups: int, per_group: int, prefix_words: int) -> list[str]:
    """`groups` x `per_group` prompts: a long random-word prefix per group, then a short
    question; interleaved (shuffled) so that a group's requests are spread over the run."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        prompts += [
            f"{prefix}.\nQuestion {g}.{i}: which word comes next?" for i in range(per_group)
        ]
    rng.shuffle(prompts)
    return prompts


def totals(cluster: Cluster) -> dict[str, float]:
    """The counters and TTFT histogram sums of all live replicas, added up."""
    out = dict.fromkeys(COUNTERS + TTFT, 0.0)
    for r in cluster.replicas:
        if r.serve is not None and r.serve.poll() is None:
            m = r.metrics()
            for k in out:
                out[k] += m.get(k, 0.0)
    return out


def run(
    cluster: Cluster, url: str, prompts: list[str], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    before = totals(cluster)
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: completion(url, p, True, max_tokens=max_tokens), prompts))
    seconds = time.monotonic() - start
    time.sleep(1.0)  # the replicas apply metrics off the engine thread
    d = {k: v - before[k] for k, v in totals(cluster).items()}
    ttfts = [r["ttft"] for r in results if "ttft" in r]
    return {
        "requests": len(prompts),
        "errors": sum(r["error"] is not None for r in results),
        "seconds": round(seconds, 2),
        "prefix_cache_hit_rate": round(d[COUNTERS[0]] / max(d[COUNTERS[1]], 1), 4),
        "prefix_cache_hits": d[COUNTERS[0]],
        "prefix_cache_queries": d[COUNTERS[1]],
        "mean_ttft_s": round(d[TTFT[0]] / max(d[TTFT[1]], 1), 4),
        "client_mean_ttft_s": round(sum(ttfts) / max(len(ttfts), 1), 4),
        "texts": [r["text"] for r in results],
    }


def kill_mid_run(
    cluster: Cluster, prompts: list[str], concurrency: int, max_tokens: int, after: float
) -> dict[str, Any]:
    """The workload under cache-aware routing; `after` s in, the replica that has served more
    of it is killed. Requests go on being sent."""
    served = [0.0, 0.0]
    base = [r.finished() for r in cluster.replicas]
    results: list[dict[str, Any]] = []
    killed: dict[str, Any] = {}

    def killer() -> None:
        time.sleep(after)
        for i, r in enumerate(cluster.replicas):
            m = r.metrics()
            served[i] = r.finished() - base[i] + m.get("vllm:num_requests_running", 0)
        victim = cluster.replicas[0 if served[0] >= served[1] else 1]
        killed.update(replica=victim.name, at=time.monotonic())
        victim.kill()
        while time.monotonic() - killed["at"] < 30:
            if cluster.router.healthy().get(victim.url) is False:
                killed["router_marked_unhealthy_after_s"] = round(
                    time.monotonic() - killed["at"], 2
                )
                return
            time.sleep(0.1)

    thread = threading.Thread(target=killer)
    thread.start()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(
            pool.map(
                lambda p: completion(cluster.router.url, p, True, max_tokens=max_tokens), prompts
            )
        )
    thread.join()
    return {"results": results, **killed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kill-after", type=float, default=4.0)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "router-bench.json"))
    args = ap.parse_args()
    shape = (args.groups, args.per_group, args.prefix_words)
    runs: list[dict[str, Any]] = []
    with running_cluster(Path(tempfile.mkdtemp(prefix="router-bench-"))) as cluster:
        for rnd in range(args.rounds):
            for policy in ("cache_aware", "round_robin"):
                if cluster.router.policy != policy:
                    cluster.restart_router(policy)
                prompts = workload(len(runs), *shape)
                result = run(
                    cluster, cluster.router.url, prompts, args.concurrency, args.max_tokens
                )
                runs.append({"policy": policy, "round": rnd, "prompts": prompts, **result})
                print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("prompts", "texts")}),
                      file=sys.stderr, flush=True)  # fmt: skip
        # the control: the served engine without a router, twice on the same prompts
        prompts = workload(len(runs), *shape)
        for again in (False, True):
            result = run(
                cluster, cluster.replicas[0].url, prompts, args.concurrency, args.max_tokens
            )
            policy = "direct_to_replica0" + ("_again" if again else "")
            runs.append({"policy": policy, "round": 0, "prompts": prompts, **result})
        cluster.restart_router("cache_aware")
        kill_prompts = workload(len(runs), *shape)
        kill = kill_mid_run(
            cluster, kill_prompts, args.concurrency, args.max_tokens, args.kill_after
        )
    all_prompts = sorted({p for r in runs for p in r["prompts"]} | set(kill_prompts))
    expected = offline_answers(all_prompts, args.max_tokens)
    report = summarize(args, runs, kill, kill_prompts, expected)
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


def count(verdicts: list[tuple[str, float | None]]) -> dict[str, Any]:
    """How many answers equal the offline engine's, and the offline margins where the others
    part from it."""
    margins = sorted((m for k, m in verdicts if k == "parted"), key=lambda m: (m is None, m or 0.0))
    return {
        "exact": len(verdicts) - len(margins),
        "parted": len(margins),
        "parting_margins": margins,
    }


def summarize(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    kill: dict[str, Any],
    kill_prompts: list[str],
    expected: dict[str, Answer],
) -> dict[str, Any]:
    per_policy: dict[str, Any] = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = [r for r in runs if r["policy"] == policy]
        verdicts = [
            judge(t, expected[p])
            for r in mine
            for p, t in zip(r["prompts"], r["texts"], strict=True)
        ]
        hits = sum(r["prefix_cache_hits"] for r in mine)
        queries = sum(r["prefix_cache_queries"] for r in mine)
        per_policy[policy] = {
            "prefix_cache_hit_rate": round(hits / max(queries, 1), 4),
            "mean_ttft_s": round(sum(r["mean_ttft_s"] for r in mine) / len(mine), 4),
            "client_mean_ttft_s": round(sum(r["client_mean_ttft_s"] for r in mine) / len(mine), 4),
            **count(verdicts),
            "requests": sum(r["requests"] for r in mine),
            "errors": sum(r["errors"] for r in mine),
        }  # fmt: skip
    outcomes = {"hung": 0, "clear_error": 0}
    errors: list[str] = []
    answered = []
    for p, r in zip(kill_prompts, kill["results"], strict=True):
        if r["seconds"] >= TIMEOUT:
            outcomes["hung"] += 1
        elif r["error"] is not None:
            outcomes["clear_error"] += 1
            errors.append(r["error"][:160])
        else:
            answered.append(judge(r["text"], expected[p]))
    outcomes |= count(answered)
    return {
        "workload": {
            "groups": args.groups,
            "requests_per_group": args.per_group,
            "prefix_words": args.prefix_words,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "streamed": True,
        },
        "oracle": "the offline engine on the same GGUF weights; parting_margins: its top-1 "
        "minus top-2 log-prob where a served answer parts from its own",
        "direct_runs_equal": sum(
            a == b for a, b in zip(runs[-2]["texts"], runs[-1]["texts"], strict=True)
        ),
        "router": "smg==1.13.0",
        "policies": per_policy,
        "runs": [{k: v for k, v in r.items() if k not in ("prompts", "texts")} for r in runs],
        "kill_mid_run": {
            "requests": len(kill_prompts),
            "killed": kill.get("replica"),
            "after_s": args.kill_after,
            "router_marked_unhealthy_after_s": kill.get("router_marked_unhealthy_after_s"),
            **outcomes,
            "errors": sorted(set(errors)),
        },
    }


if __name__ == "__main__":
    sys.exit(main())
