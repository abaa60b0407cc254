"""The gateway's request-body guard (`pagedllm.openai.request_body.too_deep`): JSON nested
past MAX_JSON_DEPTH is found without parsing it (brackets inside strings and escapes do not
count), so a body a parser would recurse into for too long is refused before it is parsed."""

from __future__ import annotations

import json

import pytest

from pagedllm.openai.request_body import MAX_JSON_DEPTH, too_deep


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("text", "deep"),
    [
        (nested(64), False),
        (nested(65), True),
        ("[{" * 32 + "}]" * 32, False),
        ("[{" * 33 + "}]" * 33, True),
        ("[" * 65, True),  # never closed: still too deep for a parser to recurse into
        (json.dumps(["[" * 100, {"a": "{" * 100}]), False),  # brackets in strings
        (json.dumps(['\\"' + "[" * 100, "\\", "]" * 3]) + nested(3), False),  # escapes
        (json.dumps(["\\"]) + nested(70), True),  # an escaped backslash ends no string
        (json.dumps({"é[": "ü" + "{" * 80}), False),  # multi-byte characters
        (nested(64) * 1000, False),
    ],
)
def test_too_deep(text: str, deep: bool) -> None:
    assert too_deep(text.encode(), MAX_JSON_DEPTH) is deep
