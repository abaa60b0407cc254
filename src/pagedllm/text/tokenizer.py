"""The model directory's `tokenizer.json`, through the `tokenizers` library (no transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from pagedllm.errors import ConfigError


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (applied when the tokenizer config asks for it)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, clean_up_spaces: bool = False) -> None:
        self._tok = tokenizer
        self.clean_up_spaces = clean_up_spaces

    @staticmethod
    def from_model_dir(model_dir: str | Path) -> Tokenizer:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise ConfigError(f"missing tokenizer.json in {str(path)!r}")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ConfigError(f"cannot load {tok_file}: {e}") from e
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        return Tokenizer(tok, bool(cfg.get("clean_up_tokenization_spaces", False)))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what a grammar engine reads)."""
        return str(self._tok.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))
        return clean_up_tokenization(text) if self.clean_up_spaces else text
