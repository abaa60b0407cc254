"""The engine on a GPU, printing one JSON document (part of scripts/gpu_check.sh; docs/gpu.md).

    python benchmarks/gpu_bench.py [--model DIR] [--big] [--quick] [--device cuda]

Measured on one model (SmolLM2-135M when prepared, else a random checkpoint of its shape), in
bf16 (fp32 on the CPU, where `--device cpu` runs the same code as a smoke test):
1. decode throughput at batch 1 / 8 / 32 / 128 (32-token prompts, 128 new tokens, greedy,
   ignore_eos), with CUDA graphs and eager;
2. TTFT of a 1k- and a 4k-token prompt (no prefix hit);
3. attention kernels alone: decode at batch 32 over 2k- and 4k-token contexts, its KV bytes
   per second against the device's bandwidth (a measured device-to-device copy, and the nominal
   peak where the device is known); prefill of a 1k-token chunk in TFLOP/s; each timed inside
   a CUDA graph, as decode runs it (events around eager calls time the host's launches);
4. the decode step's host overhead at batch 1 with graphs: (step wall time - graph replay GPU
   time) / step wall time.
With --big, the same for a random Llama-3-8B-shaped checkpoint (bf16, 16 GB) where the
device has the memory; no parity is asked of it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# nominal HBM bandwidth (bytes/s) by device name
PEAK_BANDWIDTH = {"H100 SXM": 3.35e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12,
                  "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12, "A100-SXM4-40GB": 1.56e12,
                  "L40S": 0.864e12, "L4": 0.3e12, "B200": 8.0e12}  # fmt: skip
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               tie_word_embeddings=True, max_position_embeddings=8192)  # fmt: skip
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False, max_position_embeddings=8192)  # fmt: skip


def log(msg: str) -> None:
    print(f"[gpu-bench] {msg}", file=sys.stderr, flush=True)


def random_checkpoint(path: Path, shape: dict[str, Any], dtype: torch.dtype, device: str) -> Path:
    """A random Llama checkpoint of `shape` (initialized on the device: fast), with a
    word-level tokenizer of its vocabulary (outputs are not detokenized)."""
    import transformers
    from tokenizers import Tokenizer, models

    config = transformers.LlamaConfig(**shape, rope_theta=500000.0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


def engine(model: Path, device: str, dtype: torch.dtype, eager: bool, **kw: Any) -> Any:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    config = EngineConfig.create(
        model, dtype=dtype, device=device, enforce_eager=eager, max_model_len=4608, **kw
    )
    return LLMEngine(config)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_batch(eng: Any, prompts: list[list[int]], new: int, device: str) -> float:
    """Seconds to generate `new` tokens for every prompt."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    while eng.has_unfinished_requests():
        eng.step()
    sync(device)
    return time.perf_counter() - start


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=gen).tolist()


def decode_throughput(model: Path, device: str, dtype: torch.dtype, batches: list[int],
                      new: int) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {}
    for eager in (False, True) if device.startswith("cuda") else (True,):
        eng = engine(model, device, dtype, eager, enable_prefix_caching=False,
                     max_num_seqs=max(batches))  # fmt: skip
        vocab = eng.config.model.vocab_size
        run_batch(eng, prompts_of(2, 32, vocab, 0), 4, device)  # warm-up (Triton JIT)
        key = "eager" if eager else "graphs"
        for b in batches:
            seconds = run_batch(eng, prompts_of(b, 32, vocab, b), new, device)
            out[f"{key}_batch{b}_tok_s"] = round(b * new / seconds, 1)
            log(f"{key} batch {b}: {out[f'{key}_batch{b}_tok_s']} tok/s")
        if not eager:
            out["graphs_host_overhead_batch1"] = host_overhead(eng, device)
        del eng
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def ttft(model: Path, device: str, dtype: torch.dtype) -> dict[str, Any]:
    eng = engine(model, device, dtype, False, enable_prefix_caching=False)
    vocab = eng.config.model.vocab_size
    run_batch(eng, prompts_of(1, 1024, vocab, 7), 1, device)  # warm-up
    return {
        f"ttft_{n}_ms": round(1000 * run_batch(eng, prompts_of(1, n, vocab, n), 1, device), 2)
        for n in (1024, 4096)
    }


def host_overhead(eng: Any, device: str) -> float | None:
    """1 - GPU time of one size-1 graph replay / wall time of one decode step at batch 1."""
    from pagedllm import SamplingParams

    graphs = eng.runner.graphs
    if graphs is None or 1 not in graphs.graphs:
        return None
    graph, _ = graphs.graphs[1]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, detokenize=False)
    eng.add_request("overhead", prompts_of(1, 32, eng.config.model.vocab_size, 3)[0], params)
    eng.step()  # the prefill
    walls = []
    for _ in range(50):
        sync(device)
        start = time.perf_counter()
        eng.step()
        sync(device)
        walls.append(time.perf_counter() - start)
    eng.abort_request("overhead")
    gpu = cuda_time(graph.replay)
    return round(1 - gpu / sorted(walls)[len(walls) // 2], 3)


def cuda_time(fn: Callable[[], object], iters: int = 20) -> float:
    """Median seconds of `fn` on the GPU (events around each call)."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[iters // 2]


def graphed_time(fn: Callable[[], object], reps: int = 10) -> float:
    """Seconds of one `fn` on the GPU as the engine runs it, inside a CUDA graph (`reps` calls
    captured back to back): events around eager calls would time the host's kernel launches,
    which a replay does not make."""
    fn()  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return cuda_time(graph.replay) / reps


def copy_bandwidth() -> float:
    """A device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src))


def attention_kernels(shape: dict[str, Any]) -> dict[str, Any]:
    from pagedllm.layers.attention.triton_kernels import paged_decode
    from pagedllm.layers.attention.triton_launch import (
        KernelConfig,
        num_decode_splits,
        prefill_tiles,
    )
    from pagedllm.layers.attention.triton_prefill import paged_prefill

    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape["hidden_size"] // heads
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)
    copy = copy_bandwidth()
    cfg = KernelConfig(num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    out: dict[str, Any] = {"device": name, "copy_bandwidth_gb_s": round(copy / 1e9)}
    bf16, i32 = torch.bfloat16, torch.int32
    for ctx in (2048, 4096):
        batch, block = 32, 16
        blocks = batch * ctx // block
        cache = torch.randn(blocks, 2, kv_heads, block, hd, device="cuda").to(bf16)
        tables = torch.arange(blocks, dtype=i32, device="cuda").view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=i32, device="cuda")
        q = torch.randn(batch, heads, hd, device="cuda").to(bf16)
        o = torch.empty_like(q)
        splits = num_decode_splits(batch, kv_heads, ctx, cfg)
        call = (o, q, cache, tables, lens, 0.1, splits, None, cfg)
        seconds = graphed_time(lambda call=call: paged_decode(*call))
        kv_bytes = batch * ctx * 2 * kv_heads * hd * 2
        rate = kv_bytes / seconds
        key = f"decode_attention_b{batch}_ctx{ctx}"
        out[f"{key}_us"] = round(seconds * 1e6, 1)
        out[f"{key}_of_copy_bandwidth"] = round(rate / copy, 3)
        if peak:
            out[f"{key}_of_peak_bandwidth"] = round(rate / peak, 3)
    n = 1024
    cache = torch.randn(n // 16, 2, kv_heads, 16, hd, device="cuda").to(bf16)
    q = torch.randn(n, heads, hd, device="cuda").to(bf16)
    o = torch.empty_like(q)
    req, rows = prefill_tiles([0, n], 0, cfg.prefill_block_m)
    t = lambda v: torch.tensor(v, dtype=i32, device="cuda")  # noqa: E731
    args = (cache, torch.arange(n // 16, dtype=i32, device="cuda")[None], t([0, n]), t([n]),
            t(req), t(rows), 0.1, None, cfg)  # fmt: skip
    seconds = graphed_time(lambda: paged_prefill(o, q, *args))
    flops = 4 * heads * hd * n * n / 2  # causal: half the QK^T and PV products
    out["prefill_attention_1k_us"] = round(seconds * 1e6, 1)
    out["prefill_attention_1k_tflops"] = round(flops / seconds / 1e12, 1)
    return out


def bench(model: Path, shape: dict[str, Any], device: str, quick: bool) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    batches = [1, 8] if quick else [1, 8, 32, 128]
    result: dict[str, Any] = {"model": str(model), "dtype": str(dtype).split(".")[-1]}
    result.update(decode_throughput(model, device, dtype, batches, 16 if quick else 128))
    result.update(ttft(model, device, dtype))
    if device.startswith("cuda"):
        result.update(attention_kernels(shape))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="a checkpoint dir (default: SmolLM2 or random)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--big", action="store_true", help="also a random Llama-3-8B shape")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8, 16 new tokens")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    from pagedllm.prepare import default_model_dir, is_prepared

    results: dict[str, Any] = {"torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="pagedllm-gpu-bench-") as tmp:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = args.model or default_model_dir()
        if not args.model and not is_prepared(model):
            log("SmolLM2 not prepared here: a random checkpoint of its shape")
            model = random_checkpoint(Path(tmp) / "smollm2", SMOLLM2, dtype, args.device)
        results["small"] = bench(model, SMOLLM2, args.device, args.quick)
        if args.big:
            free, _ = torch.cuda.mem_get_info()
            if free < 40 << 30:
                results["big"] = {"skipped": f"{free / 2**30:.0f} GiB free, 40 needed"}
            else:
                log("building a random Llama-3-8B-shaped checkpoint")
                big = random_checkpoint(Path(tmp) / "llama3-8b", LLAMA3_8B, dtype, args.device)
                torch.cuda.empty_cache()
                results["big"] = bench(big, LLAMA3_8B, args.device, args.quick)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
