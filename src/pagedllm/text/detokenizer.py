"""Incremental detokenization and stop strings.

`window_text` is a pure function: given a small left window of previous token ids and the
new ids, it returns the text the new ids add. Decoding the window along with the new ids keeps
the leading space of SentencePiece / byte-level tokens and joins multi-byte characters split
across tokens; a trailing U+FFFD (an incomplete UTF-8 character) is held back until the
character completes. The Triton `detokenizer` model calls it for each streamed response;
`IncrementalDetokenizer` keeps one request's ids inside the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.text.tokenizer import Tokenizer

# left context decoded along with new ids: enough for any tokenizer's merge context
WINDOW = 6
# an incomplete UTF-8 character has at most 3 bytes, so it ends at most 3 tokens back
MAX_CHAR_TOKENS = 3
# ids a caller keeps (or sends) before the new ones for `window_text`
CONTEXT = WINDOW + MAX_CHAR_TOKENS
_REPLACEMENT = "\ufffd"


def _window(tokenizer: Tokenizer, ids: Sequence[int], end: int, skip: bool) -> tuple[int, str]:
    """(start, text): up to WINDOW ids before `end`, minus leading ones inside a character (a
    byte-fallback decoder turns a whole run of byte tokens into U+FFFD when the run starts
    mid-character), and their text."""
    start = max(0, end - WINDOW)
    while True:
        text = tokenizer.decode(list(ids[start:end]), skip)
        if start == end or not text.startswith(_REPLACEMENT):
            return start, text
        start += 1


def _boundary(
    tokenizer: Tokenizer, ids: Sequence[int], end: int, skip: bool
) -> tuple[int, int, str]:
    """(k, start, text): k, the last character boundary at or before `end`: the text up to
    ids[:k] does not end inside a character. Looks back at most MAX_CHAR_TOKENS ids (further
    back, U+FFFD is what the ids really decode to)."""
    k = end
    while True:
        start, text = _window(tokenizer, ids, k, skip)
        # every id of the window trimmed away: the last ones begin an unfinished character
        inside = text.endswith(_REPLACEMENT) or start == k > 0
        if not inside or k == max(0, end - MAX_CHAR_TOKENS):
            return k, start, text
        k -= 1


def window_text(
    tokenizer: Tokenizer,
    window: Sequence[int],
    new: Sequence[int],
    skip_special_tokens: bool = True,
    final: bool = False,
) -> str:
    """The text that `new` adds after `window` (the CONTEXT ids before them), statelessly.

    Both ends are cut at character boundaries: ids of a character still incomplete at the end
    of `window` were held back by the previous call and are emitted now; an incomplete
    character at the end of `new` is held back (`final=True` flushes it, as U+FFFD, the way a
    full decode shows it). So the concatenated results of consecutive calls equal
    `tokenizer.decode(all_ids)` whatever the split."""
    ids = [*window, *new]
    left, start, prefix = _boundary(tokenizer, ids, len(window), skip_special_tokens)
    right = len(ids) if final else _boundary(tokenizer, ids, len(ids), skip_special_tokens)[0]
    if right <= left:
        return ""
    # NOTE: the text of ids[start:right] extends that of ids[start:left] for every tokenizer
    # we serve; a cleanup rule that rewrote the window's own text would break this
    return tokenizer.decode(ids[start:right], skip_special_tokens)[len(prefix) :]


@dataclass
class IncrementalDetokenizer:
    """One request's text inside the engine: `window_text` over the ids seen so far.

    NOTE: the window starts at the first output token, not in the prompt, so the text equals
    `tokenizer.decode(output_ids)` exactly (a SentencePiece decoder strips the leading space
    of the first output token, as a full decode does).
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    def add_tokens(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Append ids; return the text they complete (possibly empty). `final` flushes an
        incomplete trailing character as U+FFFD, as a full decode shows it."""
        window = self.token_ids[-CONTEXT:]
        delta = window_text(self.tokenizer, window, new_ids, self.skip_special_tokens, final)
        self.token_ids.extend(new_ids)
        self.text += delta
        return delta


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
