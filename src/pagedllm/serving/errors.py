"""The Triton error codes our models answer with, and how to tell them from a message."""

from __future__ import annotations

from typing import Literal

# Triton error codes (`pb_utils.TritonError.<code>`): the client's fault (HTTP 400, gRPC
# INVALID_ARGUMENT), the server's load or state (503 / UNAVAILABLE), a server fault (500)
Code = Literal["INVALID_ARG", "UNAVAILABLE", "INTERNAL"]
# the engine's errors that are not the request's fault start with one of these (a code does
# not survive a BLS call in Triton 2.51: the `llm` model reads it back from the message)
UNAVAILABLE_PREFIXES = ("server busy", "the engine is dead", "the engine is shutting down")
INTERNAL_PREFIXES = ("internal error", "request failed in the model runner")


class RequestError(ValueError):
    """A request that cannot be served; the message is for the client."""


def error_code(message: str) -> Code:
    """The Triton error code of an error message of this model (`Code`)."""
    text = message.removeprefix("in ensemble 'ensemble', ")
    if text.startswith(UNAVAILABLE_PREFIXES):
        return "UNAVAILABLE"
    return "INTERNAL" if text.startswith(INTERNAL_PREFIXES) else "INVALID_ARG"
