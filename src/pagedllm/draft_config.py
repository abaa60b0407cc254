"""A draft model for speculative decoding (`speculative_config={"model": DRAFT_DIR}`): its
config read and checked against the target's before anything is sized or loaded.

The draft's tokens are fed to the target and verified there, so both must speak the same
vocabulary: the same `vocab_size` and, where the draft directory has a `tokenizer.json`, the
same token -> id map. Its KV cache lies in the target's blocks (the same block tables, its own
tensors: `worker.draft_runner`), so its layers cost every block more bytes (`kv_budget`) and no
block may be freed while the draft could still read it (no freeing out of a sliding window).
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.errors import ConfigError
from pagedllm.model_config import ModelConfig
from pagedllm.spec_config import SpeculativeConfig


def draft_model_config(
    spec: SpeculativeConfig | None, target: ModelConfig, target_dir: str | Path
) -> ModelConfig | None:
    """The draft's ModelConfig (None without a draft model); ConfigError when it cannot draft
    for `target`: another vocabulary, or a model kind the draft runner does not take."""
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None
    draft = ModelConfig.from_model_dir(spec.model)
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, the "
            f"target {target.vocab_size}: a draft must share the target's tokenizer"
        )
    if draft.mla is not None or draft.hybrid is not None:
        raise ConfigError(
            "a draft model must be a plain decoder (no latent attention, no linear layers)"
        )
    _check_same_tokenizer(Path(spec.model), Path(target_dir))
    return draft


def _check_same_tokenizer(draft_dir: Path, target_dir: Path) -> None:
    """Same token -> id map, where both directories hold a tokenizer.json."""
    from tokenizers import Tokenizer

    files = [d / "tokenizer.json" for d in (draft_dir, target_dir)]
    if not all(f.exists() for f in files):
        return
    draft, target = (Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files)
    if draft != target:
        differ = sorted(set(draft.items()) ^ set(target.items()))[:3]
        raise ConfigError(
            f"the draft model's tokenizer ({files[0]}) is not the target's: a draft must share "
            f"the target's token ids (first differences: {differ})"
        )
