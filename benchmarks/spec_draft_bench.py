"""Draft-model speculative decoding on SmolLM2-135M-Instruct, printing one JSON document.

    .venv/bin/python benchmarks/spec_draft_bench.py [--quick] [--draft-layers 0-3]
        [--draft-quantization int8] [--k 3] [--max-tokens 64] [--output FILE]

The draft is SmolLM2 itself cut down to a few of its layers (`--draft-layers`, default its
first 4 of 30, with its final norm and tied embeddings: the same tokenizer, nothing
downloaded), written once next to the model in the cache. Batch 1, greedy, the model's own
stops, fp32 (the draft's KV in the target's blocks): decode tokens per second (output tokens /
wall time of `LLM.generate`, prompts included) without and with `speculative_config={"model":
DRAFT, "num_speculative_tokens": k}`, the speed-up, whether the outputs were the same, and the
drafts' acceptance per position, for input-grounded tasks and free-form chat (spec_bench's
prompts). Both engines are built once and run prompt by prompt, interleaved, so that a
drifting machine hits them alike. `--quick`: two prompts per task kind, 32 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from spec_bench import CHAT, GROUNDED, chat, decode

from pagedllm import LLM, SamplingParams
from pagedllm.prepare import prepare_smollm2


def parse_layers(text: str) -> list[int]:
    """Layers "0-3,28-29" -> [0, 1, 2, 3, 28, 29]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def truncated_draft(model: Path, layers: list[int]) -> Path:
    """`model` with only `layers` (renumbered 0..), beside it in the cache; written once."""
    name = "-".join(str(i) for i in layers)
    out = model.parent / f"{model.name}-draft-layers-{name}"
    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    renumber = {old: new for new, old in enumerate(layers)}
    tensors = {}
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if key.startswith("model.layers."):
                index = int(key.split(".")[2])
                if index not in renumber:
                    continue
                key_out = key.replace(f"model.layers.{index}.", f"model.layers.{renumber[index]}.")
            else:
                key_out = key
            tensors[key_out] = f.get_tensor(key)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = len(layers)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model / extra).exists():
            shutil.copy(model / extra, tmp / extra)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="2 prompts per task, 32 tokens")
    ap.add_argument("--draft-layers", default="0-3", help="SmolLM2 layers the draft keeps")
    ap.add_argument("--draft-quantization", default=None, help="the draft's weights: int8, ...")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    model = prepare_smollm2()
    layers = parse_layers(args.draft_layers)
    draft = truncated_draft(model, layers)
    max_tokens = 32 if args.quick else args.max_tokens
    spec_cfg = {
        "model": str(draft),
        "num_speculative_tokens": args.k,
        "quantization": args.draft_quantization,
    }
    common: dict[str, Any] = dict(quantization="none", max_model_len=1024, max_num_seqs=8)
    plain = LLM(str(model), **common)
    spec = LLM(str(model), speculative_config=spec_cfg, **common)
    tok = plain.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    per_kind = 2 if args.quick else None
    tasks = {
        "grounded": [chat(tok, t) for t in GROUNDED[:per_kind]],
        "chat": [chat(tok, t) for t in CHAT[:per_kind]],
    }
    warm = [tasks["chat"][0][:16]]
    for llm in (plain, spec):
        decode(llm, warm, SamplingParams(temperature=0, max_tokens=8))
    results = []
    counters = spec.engine.scheduler.spec.counters  # type: ignore[union-attr]
    for kind, prompts in tasks.items():
        base: dict[str, Any] = {"tokens": 0, "seconds": 0.0, "outputs": []}
        fast: dict[str, Any] = {"tokens": 0, "seconds": 0.0, "outputs": []}
        before = counters()
        for prompt in prompts:  # interleaved prompt by prompt
            for llm, acc in ((plain, base), (spec, fast)):
                tokens, seconds, outputs = decode(llm, [prompt], params)  # decode phase only
                acc["tokens"] += tokens
                acc["seconds"] += seconds
                acc["outputs"] += outputs
        rates = [acc["tokens"] / acc["seconds"] for acc in (base, fast)]
        entry = {"task": kind, "batch": 1, "tokens": base["tokens"]}
        entry["tok_s"] = {"plain": round(rates[0], 2), "draft_model": round(rates[1], 2)}
        entry["speedup"] = round(rates[1] / rates[0], 3)
        entry["same_outputs"] = base["outputs"] == fast["outputs"]
        entry.update(acceptance(before, counters()))
        print(json.dumps(entry), file=sys.stderr, flush=True)
        results.append(entry)
    doc = {
        "model": "SmolLM2-135M-Instruct (fp32)",
        "draft": f"its layers {args.draft_layers} ({len(layers)} of 30), tied embeddings",
        "speculative_config": {**spec_cfg, "model": draft.name},
        "max_tokens": max_tokens,
        "threads": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
    }
    text = json.dumps(doc, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)


def acceptance(before: tuple[Any, ...], after: tuple[Any, ...]) -> dict[str, Any]:
    """The drafts between two readings of the spec_decode counters."""
    drafts, _, accepted = (a - b for a, b in zip(after[:3], before[:3], strict=True))
    per_pos = [a - b for a, b in zip(after[3], before[3], strict=True)]
    return {
        "drafts": drafts,
        "acceptance_per_pos": [round(n / drafts, 3) if drafts else None for n in per_pos],
        "mean_accepted_per_draft": round(accepted / drafts, 3) if drafts else None,
    }


if __name__ == "__main__":
    main()
