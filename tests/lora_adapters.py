"""Random non-zero PEFT LoRA adapters on the tiny test checkpoints, saved by peft itself, and
the oracle: PeftModel greedy (and its log-probabilities)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from conftest import hf_model

# name -> (rank, alpha, rsLoRA, target modules); ranks differ, and so do targets
ADAPTERS: dict[str, tuple[int, int, bool, list[str]]] = {
    "qv": (4, 8, False, ["q_proj", "v_proj"]),
    "all": (
        8,
        16,
        True,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp_o": (2, 4, False, ["o_proj", "gate_proj", "down_proj"]),
}


def save_adapter(base: Path, out: Path, name: str, seed: int) -> Path:
    """A random adapter `name` of ADAPTERS over the checkpoint at `base`, saved at `out`."""
    from peft import LoraConfig, get_peft_model

    rank, alpha, rslora, targets = ADAPTERS[name]
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=targets,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = get_peft_model(hf_model(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # large enough that every adapter changes the greedy tokens
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path | None) -> Any:
    from peft import PeftModel

    model = hf_model(base)
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def chosen_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """The oracle's log-probability of each output token (raw logits, as the engine's)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(output)]


def fp16_copy(src: Path, out: Path) -> Path:
    """The adapter at `src` with its scale folded into B (lora_alpha = r, no rsLoRA) and every
    weight rounded to fp16: the same adapter whether read from this folder or from
    TensorRT-LLM's fp16 rows of it (`trtllm_rows`)."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((src / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    tensors = {
        k: (v * (scale if "lora_B" in k else 1.0)).half().float()
        for k, v in load_file(src / "adapter_model.safetensors").items()
    }
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config.update(lora_alpha=rank, use_rslora=False)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


# hf_lora_convert.py's map (TensorRT-LLM's examples/): HF projection -> module id
TRTLLM_MODULE_IDS = {
    "q_proj": 1,
    "k_proj": 2,
    "v_proj": 3,
    "o_proj": 4,
    "gate_proj": 5,
    "down_proj": 6,
    "up_proj": 7,
}


def trtllm_rows(folder: Path) -> tuple[Any, Any]:
    """A PEFT folder as TensorRT-LLM's hf_lora_convert.py writes it for `lora_weights` (fp16
    [N, W]: A (r, in) flattened, then B (out, r) times the scale, zero-padded) and
    `lora_config` (int32 [N, 3]: module id, layer, r)."""
    import json
    import re

    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in load_file(folder / "adapter_model.safetensors").items():
        m = re.match(r".*\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight", key)
        assert m is not None, key
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
    rows, keys = [], []
    for (layer, proj), ab in sorted(pairs.items()):
        a, b = ab["A"], ab["B"] * scale
        rows.append(torch.cat([a.flatten(), b.flatten()]).half())
        keys.append([TRTLLM_MODULE_IDS[proj], layer, a.shape[0]])
    width = max(len(r) for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    return weights.numpy(), np.array(keys, dtype=np.int32)
