"""Errors of the engine's library that callers catch by type, and how an error is told to a
client."""

import re


class ConfigError(ValueError):
    """A model directory or an engine setting that cannot be served."""


class EngineDeadError(RuntimeError):
    """The engine is poisoned (a device fault, or a fault no single request explains): every
    request in flight failed, and no request is accepted any more. Restart the engine."""


# an absolute, home or relative path of two or more components (Windows drives included)
_PATH = re.compile(r"(?:[A-Za-z]:|~|[\w.+@-]+)?(?:[\\/][\w.+@-]+){2,}[\\/]?")


def describe(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` for a client: the message's first line, file paths replaced, capped."""
    lines = str(exc).strip().splitlines()
    text = _PATH.sub("<path>", lines[0] if lines else "")
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
