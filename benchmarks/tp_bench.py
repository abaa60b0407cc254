"""Tensor parallelism: decode step time at each tensor-parallel size, with the time rank 0
waits in collectives (the step broadcast, two all-reduces per layer, the logits gather),
printing one JSON document.

    .venv/bin/python benchmarks/tp_bench.py                       # SmolLM2 (splits 1 or 3 ways)
    .venv/bin/python benchmarks/tp_bench.py --random-llama --sizes 1,2  # SmolLM2's size, 2-way
    python benchmarks/tp_bench.py --model /models/Llama-3.1-8B-Instruct --device cuda \\
        --dtype bfloat16 --sizes 1,2,4,8 --out tp-bench-h100.json       # on a GPU host

Per size: load seconds, then for each batch size the median engine step over `--tokens`
decode steps (after the prompts' prefill), tokens per second, and rank 0's collective wait
per step (on a GPU an NCCL wait returns once the op is queued: there time the whole step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pagedllm import LLM, SamplingParams


def log(msg: str) -> None:
    print(f"[tp-bench] {msg}", file=sys.stderr, flush=True)


def decode(llm: LLM, batch: int, tokens: int) -> dict[str, float]:
    eng = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", [10 + i, 20, 30, 40, 50, 60, 70, 80], params)
    eng.step()  # the prefill
    workers = eng.runner.workers
    tp = None if workers is None else workers.tp
    waited, waits = (0.0, 0) if tp is None else (tp.wait_seconds, tp.waits)
    steps = []
    while eng.has_unfinished_requests():
        start = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    out = {"step_ms": round(step * 1e3, 3), "tokens_per_s": round(batch / step, 1)}
    if tp is not None:
        out["collective_wait_ms_per_step"] = round((tp.wait_seconds - waited) / len(steps) * 1e3, 3)
        out["collectives_per_step"] = round((tp.waits - waits) / len(steps), 1)
    return out


def random_llama(dest: Path, tokenizer_dir: Path) -> Path:
    """A random Llama of SmolLM2's size that splits 2 ways: 30 layers, hidden 512, 8 query
    and 2 KV heads of 64, MLP 1536, SmolLM2's vocabulary and tokenizer (115 M parameters)."""
    import shutil

    import torch
    import transformers

    if (dest / "config.json").exists():
        return dest
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(dest, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


def run(args: argparse.Namespace, size: int) -> dict[str, Any]:
    start = time.perf_counter()
    with LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=size,
        quantization=args.quantization,
    ) as llm:
        result: dict[str, Any] = {"load_s": round(time.perf_counter() - start, 1)}
        decode(llm, 1, 8)  # warm-up
        for batch in args.batches:
            result[f"batch_{batch}"] = decode(llm, batch, args.tokens)
            log(f"tp={size} batch={batch}: {result[f'batch_{batch}']}")
    return result


def main() -> None:
    from pagedllm.prepare import prepare_smollm2

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: SmolLM2)")
    ap.add_argument(
        "--random-llama",
        action="store_true",
        help="a random Llama of SmolLM2's size with 8 query / 2 KV heads (splits 2 ways)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--sizes", default=None, help="default: 1,3 for SmolLM2, else 1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/tp-bench.json")
    args = ap.parse_args()
    default_model = args.model is None and not args.random_llama
    if args.random_llama:
        cache = Path.home() / ".cache" / "pagedllm" / "models" / "random-llama-115m"
        args.model = str(random_llama(cache, prepare_smollm2()))
    args.model = args.model or str(prepare_smollm2())
    sizes = [int(s) for s in (args.sizes or ("1,3" if default_model else "1,2")).split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    doc: dict[str, Any] = {
        "model": Path(args.model).name,
        "device": args.device,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "decode_tokens": args.tokens,
        "sizes": {str(size): run(args, size) for size in sizes},
    }
    text = json.dumps(doc, indent=2)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
