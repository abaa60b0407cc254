"""The fields a router of the SGLang family (smg, sglang-router, vllm-router) writes into every
request it forwards (docs/routing.md). These routers parse a request into their own typed
structs and serialize those, defaults included, so a plain `{"model", "prompt"}` reaches the
worker as `{..., "no_stop_trim": false, "ignore_eos": false, "skip_special_tokens": true,
"return_hidden_states": false}` (chat adds `continue_final_message`, `separate_reasoning`,
`stream_reasoning`). The gateway refuses unknown fields, so it accepts these by name:

- `skip_special_tokens`: vLLM's sampling parameter too; sent to the engine as it is;
- `no_stop_trim`, `return_hidden_states`: their defaults (false) change nothing; true asks for
  what the engine does not do and is a 400 naming the field;
- `continue_final_message`: vLLM's field too, honoured (`chat_fields`);
- `separate_reasoning`, `stream_reasoning`: they only matter with a reasoning parser, which
  this gateway has none of (SGLang without `--reasoning-parser` ignores them too): any boolean.
"""

from __future__ import annotations

from pagedllm.openai.errors import bad_request
from pagedllm.openai.structured import Strict

_UNSUPPORTED = {
    "no_stop_trim": "the stop string is always cut from the text",
    "return_hidden_states": "hidden states are not returned",
}


def _refuse_true(request: Strict, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(request, name):
            raise bad_request(f"{name}: true is not supported ({_UNSUPPORTED[name]})", name)


class RouterFields(Strict):
    """Both endpoints."""

    skip_special_tokens: bool | None = None
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    def check_router_fields(self) -> None:
        _refuse_true(self, ("no_stop_trim", "return_hidden_states"))


class ChatRouterFields(Strict):
    """Chat completions only (their `continue_final_message`: `chat_fields`)."""

    separate_reasoning: bool = True
    stream_reasoning: bool = True
