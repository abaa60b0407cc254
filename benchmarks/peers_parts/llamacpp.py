"""llama.cpp's parts, through its own binaries: GGUFs of each precision made from the shipped
Q4_1 file by llama-quantize, llama-batched-bench for decode and prefill, llama-server for the
mix, llama-perplexity on the same text."""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from peers_parts import common, install
from peers_parts.common import Budget

# our precision row -> llama.cpp's type (Q4_1: the shipped file as it is)
TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_1"}


def gguf_for(precision: str, bins: dict[str, Path], shipped: Path) -> Path:
    """The shipped Q4_1 GGUF requantized (dequantized, then stored as `precision`)."""
    kind = TYPES[precision]
    if kind == "Q4_1":
        return shipped
    out = install.peers_dir() / "gguf" / f"{shipped.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        cmd = [str(bins["llama-quantize"]), "--allow-requantize", str(shipped), str(tmp), kind]
        subprocess.run(cmd, check=True, capture_output=True)
        tmp.rename(out)
    return out


def gguf_info(path: Path) -> dict[str, Any]:
    """Bytes one decode step reads (every tensor; the embedding only as a tied LM head) and the
    tensor types."""
    import gguf

    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    if "output.weight" in sizes:  # untied: the embedding is a lookup of one row
        total -= sizes["token_embd.weight"]
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"file": path.name, "weight_bytes": total, "tensor_types": types}


def _run(cmd: list[str], timeout: float = 3600) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def batched_bench(bins: dict[str, Path], model: Path, budget: Budget) -> list[dict[str, Any]]:
    """llama-batched-bench over every (batch, context) of the budget: -npp C -ntg steps -npl B,
    one invocation per config so that each has its own KV size and load reading."""
    rows = []
    for batch, ctx in budget.decode_configs:
        before = common.loadavg()
        n_ctx = batch * (ctx + budget.decode_steps) + 64
        cmd = [str(bins["llama-batched-bench"]), "-m", str(model), "-c", str(n_ctx)]
        cmd += ["-npp", str(ctx), "-ntg", str(budget.decode_steps), "-npl", str(batch)]
        cmd += ["-t", str(common.THREADS), "-tb", str(common.THREADS), "--output-format", "jsonl"]
        lines = [ln for ln in _run(cmd).splitlines() if ln.startswith('{"n_kv_max"')]
        if len(lines) != 1:
            raise RuntimeError(f"llama-batched-bench gave {len(lines)} result lines for {cmd}")
        r = json.loads(lines[0])
        rows.append(
            {
                "batch": batch,
                "context_tokens": ctx,
                "prefill_tokens_per_s": round(r["speed_pp"], 1),
                "step_ms": round(r["t_tg"] / budget.decode_steps * 1e3, 2),
                "tokens_per_s": round(r["speed_tg"], 1),
                "flash_attn": r["flash_attn"],
                "loadavg_before": before,
                "loadavg_after": common.loadavg(),
            }
        )
    return rows


def perplexity(
    bins: dict[str, Path], model: Path, budget: Budget, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """llama-perplexity on the text (`extra`: more of its flags, e.g. the KV cache's type)."""
    before = common.loadavg()
    cmd = [str(bins["llama-perplexity"]), "-m", str(model), "-f", str(common.TEXT), *extra]
    cmd += ["-c", str(budget.ppl_ctx), "-b", str(budget.ppl_ctx), "-t", str(common.THREADS)]
    cmd += ["-tb", str(common.THREADS)]
    if budget.ppl_max_chunks:
        cmd += ["--chunks", str(budget.ppl_max_chunks)]
    out = _run(cmd)
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
    if ppl is None:
        raise RuntimeError(f"no PPL in llama-perplexity's output: {out[-2000:]}")
    return {
        "ctx": budget.ppl_ctx,
        "chunks": int(chunks.group(1)) if chunks else None,
        "scored_tokens": int(chunks.group(1)) * (budget.ppl_ctx - 1 - budget.ppl_ctx // 2)
        if chunks
        else None,
        "ppl": float(ppl.group(1)),
        "ppl_stderr": float(ppl.group(2)),
        "loadavg_before": before,
        "loadavg_after": common.loadavg(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post_stream(port: int, body: dict[str, Any], t0: float) -> tuple[float, int]:
    """(seconds from t0 to the first streamed token, tokens generated)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"llama-server: {resp.status} {resp.read()[:500]!r}")
    first, n, final = None, 0, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        msg = json.loads(line[6:])
        if msg.get("stop"):
            final = msg
            break
        got = len(msg.get("tokens") or []) or int(bool(msg.get("content")))
        if got and first is None:
            first = time.perf_counter() - t0
        n += got
    conn.close()
    assert first is not None and final is not None
    return first, int(final.get("tokens_predicted", n))


def mix(bins: dict[str, Path], model: Path, vocab: int, budget: Budget) -> dict[str, Any]:
    """The mix against `llama-server -np <concurrency> -cb`, every request sent at once (one
    thread each), streamed, greedy, EOS ignored."""
    before = common.loadavg()
    reqs = common.mix_requests(vocab, budget)
    slot = budget.mix_prompt[1] + budget.mix_output[1] + 16
    port = _free_port()
    cmd = [str(bins["llama-server"]), "-m", str(model), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-np", str(budget.mix_concurrency), "-cb"]
    cmd += ["-c", str(slot * budget.mix_concurrency), "-t", str(common.THREADS)]
    cmd += ["-tb", str(common.THREADS)]
    log = open(install.peers_dir() / "server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, server)
        body = {"temperature": 0, "ignore_eos": True, "stream": True, "cache_prompt": False}
        _post_stream(port, {**body, "prompt": [100, 101, 102], "n_predict": 2}, time.perf_counter())
        results: list[tuple[float, int] | None] = [None] * len(reqs)

        def one(i: int, t0: float) -> None:
            p, m = reqs[i]
            results[i] = _post_stream(port, {**body, "prompt": p, "n_predict": m}, t0)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i, t0)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    done = [r for r in results if r is not None]
    assert len(done) == len(reqs)
    n_out = sum(n for _, n in done)
    if n_out != sum(m for _, m in reqs):
        raise RuntimeError(f"llama-server made {n_out} tokens, not {sum(m for _, m in reqs)}")
    ttfts = [t for t, _ in done]
    return {
        **common.mix_result(len(reqs), budget.mix_concurrency, elapsed, n_out, ttfts),
        "loadavg_before": before,
        "loadavg_after": common.loadavg(),
    }


def _wait_healthy(port: int, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited ({server.returncode}): see server.log")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not become healthy")


def run_all(shipped: Path, precision: str, vocab: int, budget: Budget) -> dict[str, Any]:
    bins = install.ensure_llama_cpp()
    model = gguf_for(precision, bins, shipped)
    res = {
        "gguf": gguf_info(model),
        "decode": batched_bench(bins, model, budget),
        "mix": mix(bins, model, vocab, budget),
    }
    if precision != "bf16":  # the quality rows: fp32, int8, int4
        res["perplexity"] = perplexity(bins, model, budget)
    return res
