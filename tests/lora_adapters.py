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
