"""A POST body as JSON: its media type, size and nesting are checked before it is parsed.

- `Content-Type` must be `application/json` (or `application/*+json`; parameters such as
  `charset=utf-8` are allowed), else 415. A web page can POST `text/plain` to a gateway on
  localhost without a CORS preflight; it cannot send `application/json` without one.
- More than `max_bytes` (16 MiB by default) answers 413, before the body is read when
  `Content-Length` says so, else as soon as the bytes read pass it.
- The body must be UTF-8 (RFC 8259), else 400.
- Arrays and objects nested deeper than MAX_JSON_DEPTH answer 400 before `json.loads` (and
  pydantic, the chat template, ...) would recurse into them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from starlette.requests import Request

from pagedllm.openai.errors import APIError, bad_request

MAX_BODY_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64
# +1 for [ and {, -1 for ] and }, 0 for any other byte
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_CHUNK = 1 << 22  # bytes summed at a time (int32 running depths: 16 MiB of memory)


async def read_json(request: Request, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The decoded JSON body; APIError 415, 413 or 400."""
    check_media_type(request.headers.get("content-type"))
    return parse_json(await _read(request, max_bytes))


def check_media_type(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if kind == "application" and (subtype == "json" or subtype.endswith("+json")):
        return
    got = f"got {content_type!r}" if content_type else "the request has none"
    raise APIError(415, f"Content-Type must be application/json ({got})", param="Content-Type")


async def _read(request: Request, max_bytes: int) -> bytes:
    too_large = APIError(413, f"the request body is larger than {max_bytes} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    return bytes(body)


def parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    if too_deep(raw, MAX_JSON_DEPTH):
        raise bad_request(
            f"the request body nests arrays and objects too deeply: at most {MAX_JSON_DEPTH} "
            "levels are allowed"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # an integer of more than 4300 digits (sys.get_int_max_str_digits)
        raise bad_request("the request body holds a number with too many digits") from None


def too_deep(raw: bytes, limit: int) -> bool:
    """Whether the arrays and objects of the JSON text `raw` nest more than `limit` levels
    (brackets inside strings do not count); linear, without recursion. The bytes of a
    multi-byte UTF-8 character are never ASCII, so the scan reads bytes."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # drop escaped backslashes, then escaped quotes: left to right, as JSON reads them
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    chars = np.frombuffer(text, np.uint8)
    steps = _STEP[chars]
    # a bracket is inside a string when an odd number of quotes come before it
    steps[(np.cumsum(chars == ord('"'), dtype=np.uint8) & 1).view(np.bool_)] = 0
    depth = 0
    for start in range(0, steps.size, _CHUNK):
        running = depth + np.cumsum(steps[start : start + _CHUNK], dtype=np.int32)
        if running.max() > limit:
            return True
        depth = int(running[-1])
    return False
