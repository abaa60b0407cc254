"""Errors in OpenAI's shape, and what the gateway answers for Triton's failures.

Every error body is `{"error": {"message", "type", "param", "code"}}`, ASCII-escaped JSON (a
message may quote a client's string, which may hold a lone surrogate). A message never carries
a traceback, a file path or an exception's class name: an unexpected failure answers a generic
500 with an id, and the details go to the gateway's log under that id.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from pagedllm.openai.triton import TritonError

logger = logging.getLogger("pagedllm.openai")

# seconds a client should wait before retrying a request the server was too busy to queue
RETRY_AFTER_S = 1
# parameter names a Triton error message may name (the first one found is reported)
_PARAMS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt",
)
# what an error message must not show a client: a traceback, Triton's Python-backend stack
# ("At:" then frames), a source line, an absolute path, an exception's class name
_INTERNALS = re.compile(
    r"Traceback|^At:|File \"|(?:^|[\s'\"(=:])/[\w.-]+/|\b[A-Z]\w*(?:Error|Exception)\b", re.M
)

# the engine's refusals of a structured-output constraint (a schema, regex or grammar it cannot
# compile); they quote the client's constraint, JSON pointers ('/$defs/a') included
_CONSTRAINT = re.compile(
    r"\binvalid (?:json|json_object|regex|choice|grammar|structural_tag) constraint\b"
    r"|\b(?:json|structural_tag) is not valid JSON\b|\bstructural_tag\b|\bjson must be a JSON"
    r"|\bconstraint is too large\b|\bstructured outputs\b"
)
# what even such a refusal must not show
_TRACEBACK = re.compile(r"Traceback|^At:|File \"", re.M)

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered in OpenAI's shape: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | int | None = None,  # vLLM's errors carry the status
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else {}

    def response(self) -> JSONResponse:
        return _ErrorResponse(self.body(), status_code=self.status, headers=self.headers())


class _ErrorResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def parsed_json(text: str, param: str) -> Any:
    """`text` parsed as JSON; 400 naming `param` for text that is not JSON or nests too deeply
    for the parser."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    except RecursionError:
        raise bad_request(f"{param} is nested too deeply", param) from None


def internal_error(what: str, exc: BaseException | None = None, status: int = 500) -> APIError:
    """A generic error for the client; `what` (and `exc`'s traceback) go to the log."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s: %s", error_id, what, exc_info=exc)
    return APIError(status, f"internal error (id {error_id}); the details are in the gateway's log")


def from_triton(e: TritonError, prompt_param: str, constraint_param: str | None = None) -> APIError:
    """The answer to a failed generation: Triton's message with its status, the parameter it
    names for a refused request (`prompt_param`: `prompt` or `messages`; `constraint_param`:
    the field that carried a structured-output constraint the engine refused), 429 with
    `Retry-After` for a busy server, a generic 5xx for a message showing internals."""
    refused = constraint_param is not None and e.status == 400
    if refused and _CONSTRAINT.search(e.message) and not _TRACEBACK.search(e.message):
        # the engine names the constraint's kind (a grammar, a structural tag): the message
        # names the field the client sent it in (`tools` for the tool-call grammar)
        return APIError(400, f"{constraint_param}: {e.message}", param=constraint_param)
    if _INTERNALS.search(e.message):
        return internal_error(f"Triton answered {e.status}: {e.message}", status=max(e.status, 500))
    if e.status == 429:
        return APIError(429, e.message, code="rate_limit_exceeded")
    param = None
    if e.status == 400:
        for name in _PARAMS:
            if re.search(rf"\b{name}\b", e.message):
                param = prompt_param if name == "prompt" else name
                break
        if param is None and ("context" in e.message or "empty" in e.message):
            param = prompt_param
    return APIError(e.status, e.message, param=param)
