"""Incremental detokenization and stop strings.

`decode_window` is a pure function: given a small left window of previous token ids and the
new ids, it returns the text the new ids add. Decoding the window along with the new ids keeps
the leading space of SentencePiece / byte-level tokens and joins multi-byte characters split
across tokens; a trailing U+FFFD (an incomplete UTF-8 character) is held back until the
character completes. The Triton `detokenizer` model calls it statelessly; `IncrementalDetokenizer`
keeps the offsets for one request inside the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.text.tokenizer import Tokenizer

# previous tokens decoded along with new ones: enough for any tokenizer's merge context
WINDOW = 6
_REPLACEMENT = "\ufffd"


def decode_window(
    tokenizer: Tokenizer,
    window: Sequence[int],
    new: Sequence[int],
    skip_special_tokens: bool = True,
    final: bool = False,
) -> str | None:
    """The text `new` adds after `window`, or None while it ends inside a character (keep the
    ids pending and call again with more; `final=True` flushes whatever there is)."""
    prefix = tokenizer.decode(list(window), skip_special_tokens)
    full = tokenizer.decode([*window, *new], skip_special_tokens)
    if full.endswith(_REPLACEMENT) and not final:
        return None
    # NOTE: `full` extends `prefix` for every tokenizer we serve; a cleanup rule that rewrote
    # the window's own text would make the two disagree, and then only the growth counts
    return full[len(prefix) :]


@dataclass
class IncrementalDetokenizer:
    """Per-request state: the output ids seen, the window start and the first id not yet
    decoded.

    NOTE: the window starts at the first output token, not in the prompt, so the text equals
    `tokenizer.decode(output_ids)` exactly (a SentencePiece decoder strips the leading space
    of the first output token, as a full decode does).
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    _prefix_offset: int = 0
    _read_offset: int = 0

    def add_tokens(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Append ids; return the text they complete (possibly empty). `final` flushes an
        incomplete trailing character as U+FFFD, as a full decode shows it."""
        self.token_ids.extend(new_ids)
        delta = decode_window(
            self.tokenizer,
            self.token_ids[self._prefix_offset : self._read_offset],
            self.token_ids[self._read_offset :],
            self.skip_special_tokens,
            final,
        )
        if delta is None:
            return ""
        self._read_offset = len(self.token_ids)
        self._prefix_offset = self._window_start()
        self.text += delta
        return delta

    def _window_start(self) -> int:
        """The last WINDOW ids, minus leading ones inside a character: a byte-fallback decoder
        turns a whole run of byte tokens into U+FFFD when the run starts mid-character."""
        start = max(0, self._read_offset - WINDOW)
        while start < self._read_offset and self.tokenizer.decode(
            self.token_ids[start : self._read_offset], self.skip_special_tokens
        ).startswith(_REPLACEMENT):
            start += 1
        return start


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in text[start':] (start' reaches back to catch a stop string
    that began before `start`): (index, stop) or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters might still become a stop string (held back while
    streaming): the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
