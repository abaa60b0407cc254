"""Token ids as log-probs show them: each id's string (decoded alone, special tokens kept, as
vLLM shows tokens) and the raw bytes it stands for (chat's `bytes`), the range of ids a
token-id prompt may hold, and that of the model's logits (`logit_bias`, `allowed_token_ids`).

A byte-level BPE token that holds part of a multi-byte character decodes to U+FFFD; its bytes
are still the raw ones (the token's characters mapped back through GPT-2's byte alphabet), so
that a client joining the `bytes` of consecutive tokens gets the text back. A SentencePiece
byte-fallback token (`<0xE2>`) is that byte.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from pagedllm.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as -> the byte.
    Printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + len(chars) - len(printable)
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = byte_level_alphabet()


class TokenTexts:
    """The strings and bytes of a model's token ids (cached: a log-prob answer repeats them)."""

    def __init__(self, tokenizer: Tokenizer, model_dir: str | Path) -> None:
        self.tokenizer = tokenizer
        path = Path(model_dir)
        self._pieces = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = tokenizer.vocab_size
        config = path / "config.json"
        rows = json.loads(config.read_text()).get("vocab_size") if config.exists() else None
        # the model's logits: one per row of its embedding (logit_bias, allowed_token_ids)
        self.logits_size = rows if isinstance(rows, int) and rows > 0 else self.vocab_size
        if isinstance(rows, int) and 0 < rows < self.vocab_size:
            self.vocab_size = rows  # an id must have an embedding row too
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        added = self._pieces.get_added_tokens_decoder().values()
        # the tokenizer's special tokens (a text output skips them)
        self.special_tokens = frozenset(t.content for t in added if t.special)

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], False)
        return text

    def raw_bytes(self, token_id: int) -> list[int]:
        """The bytes `token_id` stands for (its text's UTF-8 when it is whole characters)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._raw_bytes(token_id)
        return raw

    def _raw_bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        if _REPLACEMENT in text:
            piece = self._pieces.id_to_token(token_id) or ""
            if match := _BYTE_TOKEN.fullmatch(piece):
                return [int(match.group(1), 16)]
            if piece and all(c in _BYTE_LEVEL for c in piece):
                return [_BYTE_LEVEL[c] for c in piece]
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        """A token-id prompt's text (echo), special tokens kept."""
        return self.tokenizer.decode(token_ids, False)
