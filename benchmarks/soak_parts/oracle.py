"""The oracle (each spec's greedy text, asked alone over each protocol family) and the verdict
on each reply: ok, or which way it went wrong."""

from __future__ import annotations

from collections.abc import Callable

from .plans import Plan, Reply, Spec

FAMILY = {  # the oracle family of each protocol's text
    "http_generate": "whole",
    "http_infer_llm": "whole",
    "grpc_infer_llm": "whole",
    "grpc_stream_nonstreamed": "whole",
    "http_generate_stream": "stream",
    "grpc_stream": "stream",
    "openai_completions": "stream",
    "openai_completions_stream": "stream",
    "openai_chat": "chat",
    "openai_chat_stream": "chat",
}
# the protocol that asks for each family's texts
ORACLE_PROTOCOLS = (("whole", "http_generate"), ("stream", "grpc_stream"), ("chat", "openai_chat"))
# outcomes that fail the soak
FAILURES = ("hung", "lost", "wrong_text", "unexpected_5xx", "unexpected_error")
SERVER_FAULTS = ("INTERNAL", "UNKNOWN", "UNAVAILABLE")  # gRPC codes


class Oracle:
    """The expected text of each (family, spec), and the verdict on a reply."""

    def __init__(self, timeout: float, check_text: bool = True) -> None:
        self.timeout = timeout  # a request's: a later end is `hung`
        self.texts: dict[tuple[str, Spec], str] = {}
        self.check_text = check_text  # False: differences are reported, not failures

    def build(self, specs: list[Spec], send: Callable[[Plan], Reply]) -> None:
        """Each spec once per family, one request at a time (greedy)."""
        for spec in specs:
            for family, protocol in ORACLE_PROTOCOLS:
                reply = send(Plan(protocol, "good", spec))
                if reply.end != "final":
                    raise RuntimeError(f"oracle request {protocol} {spec} failed: {reply}")
                self.texts[family, spec] = reply.text

    def classify(self, plan: Plan, reply: Reply) -> tuple[str, str]:
        """(outcome, detail): ok, wrong_text, cancelled, disconnected, rejected, busy, hung,
        lost, unexpected_5xx, unexpected_error."""
        what = f"{plan.protocol} {plan.kind} {plan.bad} {plan.spec.prompt[:40]!r}: "
        if reply.end == "timeout":
            return "hung", what + f"no end within {self.timeout} s"
        if reply.end == "truncated":
            return "lost", what + reply.message
        if reply.end == "cancelled":
            return ("disconnected" if plan.kind == "disconnect" else "cancelled"), ""
        if reply.end == "error":
            return _error(plan, reply, what)
        if plan.kind == "bad":
            return "unexpected_error", what + "a bad request was answered 200"
        if reply.finish_reason not in ("length", "stop"):
            return "lost", what + f"finish_reason {reply.finish_reason!r}"
        expected = self.texts.get((FAMILY[plan.protocol], plan.spec))
        if expected is not None and plan.echo and FAMILY[plan.protocol] == "whole":
            expected = plan.spec.prompt + expected
        checked = plan.greedy and plan.kind != "cancel"
        if checked and expected is not None and reply.text != expected:
            return "wrong_text", what + f"{reply.text[:80]!r} != {expected[:80]!r}"
        return "ok", ""


def _error(plan: Plan, reply: Reply, what: str) -> tuple[str, str]:
    detail = what + f"{reply.status or reply.code or 'stream error'}: {reply.message[:200]}"
    server_fault = (reply.status or 0) >= 500 or reply.code in SERVER_FAULTS
    if "server busy" in reply.message or reply.status == 429:
        return "busy", detail
    if server_fault or "internal error" in reply.message.lower():
        return "unexpected_5xx", detail
    if plan.kind == "bad":
        return "rejected", ""
    return "unexpected_error", detail
