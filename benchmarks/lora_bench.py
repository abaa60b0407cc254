"""Multi-LoRA benchmark, printing one JSON document.

    .venv/bin/python benchmarks/lora_bench.py [--model DIR] [--requests 32] [--adapters 4]
                                              [--rank 16] [--prompt-len 32] [--max-tokens 32]

Without --model: SmolLM2-135M-Instruct from $PAGEDLLM_CACHE (`python -m pagedllm.prepare`).
Random adapters (every q/k/v/o/gate/up/down projection, rank --rank) are written as PEFT
folders in a temporary directory. Measured, one engine each, greedy, output tokens / s:
1. `base`: --requests requests on the base model, an engine without LoRA;
2. `base_lora_engine`: the same on an engine with LoRA on (no adapter in the batch);
3. `mixed`: the same requests spread over --adapters adapters (max_loras = --adapters), one
   batch: every step runs every adapter through the batched LoRA computation.
And the cost of swapping an adapter in: reading a folder (host cache miss) and writing a
host-cached adapter into a device slot.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.lora.adapter import expected_shapes, load_adapter
from pagedllm.prepare import default_model_dir


def write_adapter(path: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT folder with random A and B (B scaled so the adapter changes the output)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, (out, inp) in expected_shapes(cfg).items():
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(expected_shapes(cfg)),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int, loras: Any) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    inputs: Any = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:2], params, use_tqdm=False, lora_request=loras and loras[:2])  # warm
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    path = args.model or str(default_model_dir())
    cfg = ModelConfig.from_model_dir(path)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, cfg.vocab_size) for _ in range(args.prompt_len)]
        for _ in range(args.requests)
    ]
    knobs: dict[str, Any] = dict(
        device="cpu", max_num_seqs=args.requests, enable_prefix_caching=False
    )
    with tempfile.TemporaryDirectory() as tmp:
        loras = [
            LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, i)))
            for i in range(args.adapters)
        ]
        result: dict[str, Any] = {**vars(args), "model": path}
        with LLM(path, **knobs) as llm:
            result["base_tok_s"] = round(timed_generate(llm, prompts, args.max_tokens, None), 1)
        lora_knobs = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
        with LLM(path, **knobs, **lora_knobs) as llm:
            result["base_lora_engine_tok_s"] = round(
                timed_generate(llm, prompts, args.max_tokens, None), 1
            )
            mixed = [loras[i % len(loras)] for i in range(args.requests)]
            result["mixed_tok_s"] = round(timed_generate(llm, prompts, args.max_tokens, mixed), 1)
            slots = llm.engine.runner.lora
            assert slots is not None
            start = time.perf_counter()
            for _ in range(5):
                load_adapter(loras[0], cfg, args.rank)
            result["swap_read_folder_ms"] = round((time.perf_counter() - start) / 5 * 1e3, 2)
            start = time.perf_counter()
            for _ in range(5):
                slots.load(0, loras[0])
            result["swap_host_to_slot_ms"] = round((time.perf_counter() - start) / 5 * 1e3, 2)
        result["mixed_vs_base"] = round(result["mixed_tok_s"] / result["base_tok_s"], 3)
        result["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
