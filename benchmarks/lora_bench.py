"""Multi-LoRA benchmark, printing one JSON document.

    .venv/bin/python benchmarks/lora_bench.py [--quick] [--model DIR] [--requests 32]
        [--adapters 4] [--rank 16] [--prompt-len 32] [--max-tokens 32] [--rounds 5]

Without --model: SmolLM2-135M-Instruct from $PAGEDLLM_CACHE (`python -m pagedllm.prepare`).
Random adapters (every q/k/v/o/gate/up/down projection, rank --rank) are written as PEFT
folders in a temporary directory. Two engines live side by side, and each round runs, one
after the other, greedy, --requests requests of --prompt-len random tokens and --max-tokens
output tokens:
1. `base`: on the base model, an engine without LoRA;
2. `base_lora_engine`: the same on an engine with LoRA on (no adapter in the batch);
3. `mixed`: the same requests spread over --adapters adapters (max_loras = --adapters) on
   that engine, one batch: every step runs every adapter's deltas.
The output tokens / s of each is the batch's tokens over its median time across the rounds
(interleaved, so drift in the machine's load hits them alike); the goal is mixed >= 0.8x
base. `decode_path`, per batch: its decode steps that ran the layers in the one C++ call
(csrc/decoder.cpp, adapters included) and the median ms of that call (the decode step's
layers alone, without the prefill, the sampler or the scheduler: `mixed_vs_base_decode_step`
compares them), and its passes op by op (prefill chunks; batches past the linear kernels'
rows). And the cost of swapping an adapter in: reading a folder (host cache miss) and
writing a host-cached adapter into a device slot. `--quick`: 16 requests, 16 tokens, 3
rounds. `--threads 1` spares a shared machine's cores the threads' waits on each other.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gemv_bench import median_ms  # benchmarks/ is the script's directory
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.layers.attention import cpu_kernels
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


class Paths:
    """How each run's forward passes run the layers: its one-C++-call decode steps (their
    times) and its op-by-op passes (prefill chunks; batches past the kernels' rows)."""

    def __init__(self, models: list[Any]) -> None:
        self.run = ""  # the run now going
        self.one_call: dict[str, list[float]] = {}  # run -> each decode_layers call's seconds
        self.op_by_op: dict[str, int] = {}
        module = cpu_kernels.kernel_module()
        if module is not None:
            real_call = module.decode_layers

            def one_call(*args: Any) -> torch.Tensor:
                start = time.perf_counter()
                out = real_call(*args)
                self.one_call.setdefault(self.run, []).append(time.perf_counter() - start)
                return out

            module.decode_layers = one_call
        for model in models:
            model._layers = self._counted(model._layers)

    def _counted(self, real: Any) -> Any:
        def op_by_op(*args: Any) -> torch.Tensor:
            self.op_by_op[self.run] = self.op_by_op.get(self.run, 0) + 1
            return real(*args)

        return op_by_op

    def report(self, runs: list[str], rounds: int) -> dict[str, Any]:
        """Per run: decode steps in one call and passes op by op per batch, the one call's
        median ms."""
        return {
            run: {
                "one_call_steps": len(self.one_call.get(run, [])) / rounds,
                "op_by_op_passes": self.op_by_op.get(run, 0) / rounds,
                "one_call_median_ms": round(
                    statistics.median(self.one_call.get(run, [0.0])) * 1e3, 2
                ),
            }
            for run in runs
        }


def batch_runner(
    paths: Paths, name: str, llm: LLM, prompts: list[list[int]], max_tokens: int, loras: Any
) -> Any:
    """A call that generates the whole batch (checking it produced every token)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    inputs: Any = [{"prompt_token_ids": p} for p in prompts]

    def run() -> None:
        paths.run = name
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * max_tokens
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    return run


def swap_costs(llm: LLM, lora: LoRARequest, cfg: ModelConfig, rank: int) -> dict[str, float]:
    slots = llm.engine.runner.lora
    assert slots is not None
    start = time.perf_counter()
    for _ in range(5):
        load_adapter(lora, cfg, rank)
    read = (time.perf_counter() - start) / 5
    start = time.perf_counter()
    for _ in range(5):
        slots.load(0, lora)
    write = (time.perf_counter() - start) / 5
    return {
        "swap_read_folder_ms": round(read * 1e3, 2),
        "swap_host_to_slot_ms": round(write * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--quick", action="store_true", help="16 requests, 16 tokens, 3 rounds")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.requests, args.max_tokens, args.rounds = 16, 16, 3
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
    lora_knobs = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [
            LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, i)))
            for i in range(args.adapters)
        ]
        mixed = [loras[i % len(loras)] for i in range(args.requests)]
        result: dict[str, Any] = {**vars(args), "model": path}
        with LLM(path, **knobs) as base, LLM(path, **knobs, **lora_knobs) as with_lora:
            paths = Paths([base.engine.runner.model, with_lora.engine.runner.model])
            batches = {"base": (base, None), "base_lora_engine": (with_lora, None)}
            batches["mixed"] = (with_lora, mixed)
            runs = [
                batch_runner(paths, name, llm, prompts, args.max_tokens, requests)
                for name, (llm, requests) in batches.items()
            ]
            ms = median_ms(runs, args.rounds)  # a warm-up run each, then the rounds
            tokens = args.requests * args.max_tokens
            for name, t in zip(batches, ms, strict=True):
                result[f"{name}_tok_s"] = round(tokens / t * 1e3, 1)
            result["decode_path"] = paths.report(list(batches), args.rounds + 1)
            result.update(swap_costs(with_lora, loras[0], cfg, args.rank))
        result["mixed_vs_base"] = round(result["mixed_tok_s"] / result["base_tok_s"], 3)
        steps = result["decode_path"]
        result["mixed_vs_base_decode_step"] = round(
            steps["base"]["one_call_median_ms"] / steps["mixed"]["one_call_median_ms"], 3
        )
        result["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
