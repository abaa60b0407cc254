"""Per-request generation settings, with vLLM's names and meanings.

Values may arrive as strings from Triton clients ("0.7", "64", "true"/"false"); they are
converted here, and anything that cannot be served is rejected with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.beam_search import BeamSearchParams as BeamSearchParams  # vLLM's home for it
from pagedllm.convert import to_bool
from pagedllm.structured.params import StructuredOutputsParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_BAD_WORDS = 100  # per list: bad_words, bad_words_ids
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 64  # per sequence of bad_words_ids
DEFAULT_MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # |bias| at most this (OpenAI's range, -100 to 100)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


def _to_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:  # exact for integers beyond 2**53, which a float would round
            return int(value.strip())
        except ValueError:
            pass
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if not as_float.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(as_float)


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return out


def _to_int_list(name: str, value: Any) -> list[int]:
    if isinstance(value, str | int):
        value = [value]
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return [_to_int(name, v) for v in value]


def _to_str_list(name: str, value: Any) -> list[str]:
    """None, one string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    return list(value)


def _to_bias(value: Any) -> dict[int, float] | None:
    """logit_bias: token id (an integer, or its string: JSON keys are strings) -> bias."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {value!r}")
    return {
        _to_int("logit_bias key", k): _to_float(f"logit_bias[{k}]", v) for k, v in value.items()
    }


def _to_id_lists(name: str, value: Any) -> list[list[int]]:
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, list | tuple) for v in value):
        raise ValueError(f"{name} must be a list of lists of token ids, got {value!r}")
    return [_to_int_list(name, v) for v in value]


@dataclass
class SamplingParams:
    """How to generate for one request (vLLM's `SamplingParams` names and meanings)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # words never to generate (see `update_from_tokenizer`), and token sequences as given
    bad_words: list[str] = field(default_factory=list)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # added to the logits of these token ids before penalties (vLLM's order); -100..100
    logit_bias: dict[int, float] | None = None
    # only these token ids may be generated (vLLM's allowed_token_ids)
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # False: token ids only, no text (a caller that decodes elsewhere); stop strings need text
    detokenize: bool = True
    # accepted for vLLM compatibility; fast tokenizers ignore it, as in vLLM
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # the output must match a JSON schema, regex, grammar, ... (`pagedllm.structured`); a
    # dict is read as `StructuredOutputsParams.from_dict`
    structured_outputs: StructuredOutputsParams | None = None
    # set by the engine (`update_from_tokenizer`): the token sequences the sampler bans
    _bad_words_token_ids: list[list[int]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._convert()
        self._validate()

    @staticmethod
    def from_dict(values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON object; unknown keys are an error naming them."""
        fields = dataclasses.fields(SamplingParams)
        names = {f.name for f in fields if f.init} - {"output_kind"}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(unknown)}")
        return SamplingParams(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    def _convert(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _to_int(name, getattr(self, name)))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _to_int(name, getattr(self, name)))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            setattr(self, name, _to_float(name, getattr(self, name)))
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "detokenize",
            "spaces_between_special_tokens",
        ):
            setattr(self, name, to_bool(name, getattr(self, name)))
        self.stop = _to_str_list("stop", self.stop)
        self.stop_token_ids = _to_int_list("stop_token_ids", self.stop_token_ids or [])
        self.bad_words = _to_str_list("bad_words", self.bad_words)
        self.bad_words_ids = _to_id_lists("bad_words_ids", self.bad_words_ids)
        self.logit_bias = _to_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _to_int_list("allowed_token_ids", self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise ValueError(
                f"structured_outputs must be an object, got {self.structured_outputs!r}"
            )

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                f"logprobs must be non-negative, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}",
            ),
            (
                len(self.stop) <= MAX_STOP_STRINGS,
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
            ),
            (
                all(0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
                f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters",
            ),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (
                len(self.bad_words) <= MAX_BAD_WORDS,
                f"at most {MAX_BAD_WORDS} bad_words, got {len(self.bad_words)}",
            ),
            (
                all(0 < len(w) <= MAX_BAD_WORD_CHARS and w.strip() for w in self.bad_words),
                f"bad_words must have 1 to {MAX_BAD_WORD_CHARS} characters, not all whitespace",
            ),
            (
                len(self.bad_words_ids) <= MAX_BAD_WORDS,
                f"at most {MAX_BAD_WORDS} bad_words_ids sequences, got {len(self.bad_words_ids)}",
            ),
            (
                all(0 < len(s) <= MAX_BAD_WORD_TOKENS for s in self.bad_words_ids),
                f"bad_words_ids sequences must have 1 to {MAX_BAD_WORD_TOKENS} token ids",
            ),
            (
                all(t >= 0 for s in self.bad_words_ids for t in s),
                "bad_words_ids must be non-negative",
            ),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids must not be empty",
            ),
            (self.detokenize or not self.stop, "stop strings need detokenize=True"),
            (
                self.seed is None or 0 <= self.seed < 2**63,
                f"seed must be in [0, 2**63), got {self.seed}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.check_token_ids()
        if self.top_k == 0:
            self.top_k = -1

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token sequences never to generate (empty until `update_from_tokenizer`)."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, encode: Callable[[str], list[int]], vocab_size: int) -> None:
        """Resolve `bad_words` to token sequences as vLLM does, plus `bad_words_ids` as given.
        Each word, left-stripped, is encoded (no special tokens) as is and with a leading space;
        the spaced form is banned too when it starts with another token but has as many tokens
        (a word mid-text). Raises ValueError for a word with no tokens or an id >= vocab_size."""
        banned: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            if not plain:
                raise ValueError(f"bad word {word!r} encodes to no tokens")
            banned.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                banned.append(spaced)
        banned += self.bad_words_ids
        if any(t >= vocab_size for seq in banned for t in seq):
            raise ValueError(f"bad_words token ids must be in [0, {vocab_size})")
        self._bad_words_token_ids = banned

    def check_token_ids(self, vocab_size: int | None = None) -> None:
        """logit_bias and allowed_token_ids: token ids in [0, vocab_size) (any non-negative
        id without a vocabulary), biases in [-100, 100]; ValueError naming the first bad one."""
        high = f" (an integer from 0 to {vocab_size - 1})" if vocab_size else ""
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"logit_bias: {token} is not a token id{high}")
            if abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias[{token}]: {bias} is outside [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}]"
                )
        for k, token in enumerate(self.allowed_token_ids or ()):
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"allowed_token_ids[{k}]: {token} is not a token id{high}")

    def check_logprobs_cap(self, max_logprobs: int) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name} must be at most {max_logprobs}, got {value}")


_EPS = 1e-5
