"""Request fields both endpoints take beyond OpenAI's sampling ones: OpenAI's `logit_bias` and
vLLM's extras (`extra_body` in the `openai` client), checked as vLLM checks them, each refusal
a 400 naming the field.

- `logit_bias` (OpenAI's): token id (a JSON key: a string of digits) -> a bias from -100 to
  100, added to that token's logit before penalties (the engine's sampler).
- `allowed_token_ids`: only these ids may be generated; not empty.
- `prompt_logprobs` (0-20): the log-probs of the prompt's tokens, with that many alternatives;
  not streamed (vLLM refuses it with `stream`).
- `return_token_ids`: the prompt's and the output's token ids on each choice.
- `return_tokens_as_token_ids`: log-prob tokens spelled `token_id:N`.
- `truncate_prompt_tokens`: keep the prompt's last N tokens (-1: the model's context); more
  than the context is refused with vLLM's message.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictFloat, StrictInt

from pagedllm.openai.errors import bad_request
from pagedllm.openai.structured import Strict

INT32_MAX = 2**31 - 1  # token counts and top_k travel as int32 in the engine
# top alternatives per token in log-probs: vLLM's default max_logprobs (OpenAI's is 5)
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100  # OpenAI's range: -100 to 100


class VllmFields(Strict):
    logit_bias: dict[str, StrictFloat] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)

    def check_vllm_fields(self, stream: bool) -> None:
        if self.prompt_logprobs is not None and stream:
            message = "prompt_logprobs are not available when stream is true"
            raise bad_request(message, "prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            message = "truncate_prompt_tokens must be -1 (the model's context) or at least 1"
            raise bad_request(message, "truncate_prompt_tokens")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad_request("allowed_token_ids must not be empty", "allowed_token_ids")

    def token_parameters(self, vocab_size: int) -> dict[str, Any]:
        """`logit_bias` and `allowed_token_ids` as the engine's sampling parameters, every id
        checked against the vocabulary (0 to vocab_size - 1)."""
        ids = f"an integer from 0 to {vocab_size - 1}"
        out: dict[str, Any] = {}
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                token = int(key) if key.isascii() and key.isdigit() else -1
                if not 0 <= token < vocab_size:
                    shown = key if len(key) <= 40 else key[:37] + "..."
                    message = f"logit_bias: {shown!r} is not a token id ({ids})"
                    raise bad_request(message, "logit_bias")
                if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    message = (
                        f"logit_bias[{key}]: {value:g} is outside the range "
                        f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
                    )
                    raise bad_request(message, "logit_bias")
                bias[str(token)] = value
            out["logit_bias"] = bias
        if self.allowed_token_ids:
            for k, token in enumerate(self.allowed_token_ids):
                if not 0 <= token < vocab_size:
                    param = f"allowed_token_ids[{k}]"
                    raise bad_request(f"{param}: {token} is not a token id ({ids})", param)
            out["allowed_token_ids"] = list(self.allowed_token_ids)
        return out

    def truncation(self, max_model_len: int | None) -> int | None:
        """How many of the prompt's last tokens to keep (None: all), as vLLM reads
        `truncate_prompt_tokens`: -1 is the model's context, more than it is refused."""
        keep = self.truncate_prompt_tokens
        if keep is None or max_model_len is None:
            return None if keep is None or keep < 0 else keep
        if keep < 0:
            return max_model_len
        if keep > max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                f"({max_model_len}). Please, select a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        return keep
