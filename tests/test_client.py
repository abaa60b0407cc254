"""The clients in `client/` as a user runs them (`python -m client.stream`, `python -m
client.benchmark`, subprocesses from the repository root) against a real tritonserver serving
the tiny llama checkpoint through `ensemble`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_server import offline_text

from pagedllm import LLM
from pagedllm.serving.tritonserver import TritonServer, free_port

SHARES_SERVER = True  # conftest's session server: requests only, metrics read as deltas
REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"
MAX_TOKENS = 12


def greedy(llm: LLM, **extra: Any) -> str:
    return offline_text(llm, PROMPT, max_tokens=MAX_TOKENS, **extra)


def run(module: str, *args: str, timeout: float = 180) -> tuple[int, str, str]:
    """`python -m module args` from the repository root: (exit code, stdout, stderr). Bytes are
    decoded here, not by universal newlines, so a generated '\\r' survives."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def stream(server: TritonServer, *args: str) -> tuple[int, str, str]:
    return run("client.stream", PROMPT, "--url", server.grpc_url, *args)


def summary(stderr: str) -> dict[str, str]:
    """The key=value summary line of client.stream."""
    return dict(item.split("=", 1) for item in stderr.strip().splitlines()[-1].split())


def test_stream_prints_the_offline_greedy_text(server: TritonServer, llm: LLM) -> None:
    code, out, err = stream(server, "--max-tokens", str(MAX_TOKENS), "--ignore-eos")
    assert code == 0, err
    assert out == greedy(llm) + "\n"
    info = summary(err)
    assert info["finish_reason"] == "length"
    assert info["output_tokens"] == str(MAX_TOKENS)
    assert float(info["ttft_ms"]) > 0 and float(info["tokens_per_s"]) > 0


def test_stream_stop_string_and_json_parameters(server: TritonServer, llm: LLM) -> None:
    full = greedy(llm)
    # a printable two-character stop string from the middle of the greedy text
    stop = next(
        (full[i : i + 2] for i in range(2, len(full) - 1) if full[i : i + 2].isprintable()),
        None,
    )
    if stop is None or "\ufffd" in stop:
        pytest.skip(f"no usable stop string in {full!r}")
    code, out, err = stream(
        server, "--max-tokens", str(MAX_TOKENS), "--sampling-parameters", '{"ignore_eos": true}',
        "--stop", stop,
    )  # fmt: skip
    assert code == 0, err
    assert out == greedy(llm, stop=[stop]) + "\n"
    assert summary(err)["finish_reason"] == "stop"


def test_stream_reports_the_servers_error(server: TritonServer) -> None:
    code, out, err = stream(server, "--sampling-parameters", '{"bogus": 1}')
    assert code == 1
    assert "unknown sampling parameters: bogus" in err
    assert "Traceback" not in err and out == ""


def test_stream_unreachable_server() -> None:
    code, out, err = run("client.stream", PROMPT, "--url", f"127.0.0.1:{free_port()}")
    assert code == 1
    assert "cannot reach a Triton server" in err
    assert "Traceback" not in err and out == ""


def test_benchmark_tiny(server: TritonServer, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    code, out, err = run(
        "client.benchmark", "--url", server.grpc_url, "--model-dir", str(checkpoints["llama"]),
        "--dtype", "float32", "--concurrency", "1", "2", "--num-requests", "4",
        "--max-tokens", "8", "--prompt-len", "16", "--torch-threads", "1",
        "--output", str(output),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert json.loads(output.read_text()) == report
    assert report["dtype"] == "float32" and report["triton_model"] == "ensemble"
    assert report["git"]["commit"] and report["machine"]["cpu_count"] >= 1
    assert report["machine"]["torch_threads"] == 1
    assert set(report["definitions"]) >= {"served_tokens_per_s", "per_token_overhead_ms"}
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        c, served, offline = r["concurrency"], r["served"], r["offline"]
        # every request streamed all its tokens, in order, and ended with "length"
        assert served["num_requests"] == served["requests_complete"] == 4
        assert served["output_tokens"] == offline["output_tokens"] == 4 * 8
        assert served["responses_per_request"] >= 8
        assert 1 <= served["max_streaming"] <= c
        assert offline["prefix_cache_hit_tokens"] == 0
        assert offline["cpu_s"] > 0
        # --url: not the benchmark's own server, whose processes it would count
        assert "cpu_s" not in served and r["serving_cpu_s"] is None
        assert r["served_tokens_per_s"] > 0 and r["offline_tokens_per_s"] > 0
        assert r["ratio"] == pytest.approx(
            r["served_tokens_per_s"] / r["offline_tokens_per_s"], 1e-2
        )
        overhead = (1 / r["served_tokens_per_s"] - 1 / r["offline_tokens_per_s"]) * c * 1000
        assert r["per_token_overhead_ms"] == pytest.approx(overhead, abs=0.05)
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"]
        assert r["itl_ms"]["p50"] > 0
        assert 0 <= r["served_texts_equal_offline"] <= 4
    assert report["server"]["stream_interval"] is None  # --url: the server's own setting
    code, _, err = run("client.benchmark", "--url", server.grpc_url, "--stream-interval", "2")
    assert code == 2 and "sets a server started here" in err


def test_benchmark_counts_its_own_servers_cpu(checkpoints: dict[str, Path]) -> None:
    """Started by the benchmark, the server's processes are counted per model: the CPU of
    the served run, outside the engine too (serving_cpu_s: tritonserver, the text models'
    stubs, the client); and its prefix-cache hits, from its metrics."""
    code, out, err = run(
        "client.benchmark", "--model-dir", str(checkpoints["llama"]), "--dtype", "float32",
        "--concurrency", "2", "--num-requests", "4", "--max-tokens", "8", "--prompt-len", "16",
        "--no-offline", "--rounds", "2",
    )  # fmt: skip
    assert code == 0, err
    [r] = json.loads(out)["results"]
    # each round its own prompts (16 tokens: one full KV block each), so no round hits what
    # the server cached in the round before
    assert [x["served_prefix_cache_hit_tokens"] for x in r["rounds"]] == [0, 0]
    cpu_s = r["served"]["cpu_s"]
    assert {"tritonserver", "stub:llm_engine", "stub:tokenizer", "stub:detokenizer", "client"} <= (
        set(cpu_s)
    )
    assert cpu_s["stub:llm_engine"] > 0 and cpu_s["client"] > 0
    serving = sum(v for k, v in cpu_s.items() if k != "stub:llm_engine")
    assert r["serving_cpu_s"] == pytest.approx(serving, abs=0.02)
    assert r["serving_cpu_ms_per_token"] == pytest.approx(serving / (4 * 8) * 1000, rel=0.01)
