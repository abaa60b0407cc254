"""The served model as `/v1/models` lists it, in vLLM's card: `id`, `object`, `created`,
`owned_by`, `root` (the model directory the gateway reads), `parent` (null), `max_model_len`
and `permission` (one `model_permission` entry, as vLLM's); a LoRA adapter's card has its
folder as `root` and the base model's id as `parent` (`openai.lora_admin`).

`max_model_len` is the engine's: `llm_engine`'s `max_model_len` parameter as Triton reports
its config (asked once, when first needed), else — 0 there, or Triton not asked yet — the
model's context as the engine reads it from `config.json`. `truncate_prompt_tokens` is checked
against it too.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

from pagedllm.openai.triton import TritonBridge

logger = logging.getLogger("pagedllm.openai")
# the engine's model in the repository (docs/contract.md)
ENGINE_MODEL = "llm_engine"


def model_context(model_dir: str | Path) -> int | None:
    """The model's context length as the engine reads it (None if it cannot be read)."""
    from pagedllm.model_config import ModelConfig

    try:
        return ModelConfig.from_model_dir(model_dir).context_length
    except Exception:  # an unknown architecture: the card goes without it
        logger.warning("the context length of %s cannot be read", model_dir, exc_info=True)
        return None


class ServedModel:
    def __init__(self, name: str, model_dir: str, bridge: TritonBridge) -> None:
        self.name = name
        self.root = model_dir
        self.bridge = bridge
        self.created = int(time.time())
        self.context = model_context(model_dir)
        self._engine_len: int | None = None  # llm_engine's max_model_len, once read

    async def max_model_len(self) -> int | None:
        if self._engine_len is None:
            self._engine_len = await self._engine_max_model_len()
        return self._engine_len or self.context

    async def _engine_max_model_len(self) -> int | None:
        """`llm_engine`'s max_model_len parameter (0: the model's context); None when Triton
        cannot say (asked again next time)."""
        try:
            config = await self.bridge.client().get_model_config(ENGINE_MODEL, as_json=True)
            value = config["config"]["parameters"]["max_model_len"]["string_value"]
            return max(int(value), 0)
        except Exception:
            return None

    async def card(self) -> dict[str, Any]:
        return self._card(self.name, self.root, None, await self.max_model_len())

    def adapter_card(self, name: str, path: str) -> dict[str, Any]:
        """A LoRA adapter's card, as vLLM's: its folder as `root`, the base model as `parent`,
        no `max_model_len`."""
        return self._card(name, path, self.name, None)

    def _card(
        self, name: str, root: str, parent: str | None, max_model_len: int | None
    ) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
