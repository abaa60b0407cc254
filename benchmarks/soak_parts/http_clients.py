"""The soak's HTTP clients: Triton's generate / generate_stream and KServe infer, and the
gateway's /v1 completions and chat completions, streamed or not. One connection per request,
closed to cancel or disconnect."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

from .bad_inputs import JSON, content_type, triton_body
from .plans import Plan, Reply, gateway_body, triton_datatype, triton_values


class Http:
    """Requests to one HTTP server, one connection each (closed to cancel or disconnect)."""

    def __init__(self, port: int) -> None:
        self.port = port

    @contextlib.contextmanager
    def post(
        self, path: str, body: bytes, timeout: float, content_type: str = JSON
    ) -> Iterator[tuple[http.client.HTTPConnection, socket.socket]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": content_type})
            assert conn.sock is not None
            yield conn, conn.sock
        finally:
            conn.close()

    def call(
        self, path: str, body: bytes, timeout: float, content_type: str = JSON, leave: float = 0
    ) -> Reply:
        """A non-streamed request; Reply.text holds the raw body of a 200. With `leave` > 0 the
        client hangs up if no answer has come within `leave` seconds (Reply end `cancelled`)."""
        try:
            with self.post(path, body, timeout, content_type) as (conn, sock):
                sock.settimeout(leave or timeout)
                try:
                    response = conn.getresponse()
                except TimeoutError:
                    if not leave:
                        raise
                    hang_up(sock)
                    return Reply("cancelled")
                sock.settimeout(timeout)
                raw = response.read().decode("utf-8", "replace")
        except TimeoutError:
            return Reply("timeout")
        except (http.client.HTTPException, OSError) as e:
            return Reply.broken(e)
        if response.status != 200:
            return Reply("error", status=response.status, message=raw[:300])
        return Reply("final", raw, status=200)

    def events(
        self, path: str, body: bytes, timeout: float, cancel_after: int, content_type: str = JSON
    ) -> tuple[Reply, list[Any]]:
        """A server-sent-events request: its `data:` payloads (JSON, or "[DONE]"); closed after
        `cancel_after` of them when that is > 0 (Reply end `cancelled`)."""
        deadline = time.monotonic() + timeout
        events: list[Any] = []
        try:
            with self.post(path, body, timeout, content_type) as (conn, sock):
                response = conn.getresponse()
                if response.status != 200:
                    raw = response.read().decode("utf-8", "replace")
                    return Reply("error", status=response.status, message=raw[:300]), events
                while line := response.readline():
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
                        if len(events) == cancel_after:
                            hang_up(sock)
                            return Reply("cancelled"), events
                    if time.monotonic() > deadline:
                        return Reply("timeout"), events
        except TimeoutError:
            return Reply("timeout"), events
        except (http.client.HTTPException, OSError, ValueError) as e:
            return Reply.broken(e), events
        return Reply("final", status=200), events


def hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def stream_error(events: list[Any]) -> Reply | None:
    """The first error event of a stream (a 200 whose stream then failed), or None."""
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    return Reply("error", status=200, message=str(errors[0])[:300]) if errors else None


def kserve_body(values: dict[str, Any]) -> dict[str, Any]:
    inputs = [
        {"name": k, "shape": [1], "datatype": triton_datatype(v), "data": [v]}
        for k, v in values.items()
    ]
    return {"inputs": inputs}


def triton_http(http: Http, plan: Plan, protocol: str, timeout: float) -> Reply:
    """http_infer_llm (KServe infer on `llm`), http_generate or http_generate_stream."""
    if protocol == "http_infer_llm":
        values = triton_values(plan, stream=False)
        reply = http.call("/v2/models/llm/infer", json.dumps(kserve_body(values)).encode(), timeout)
        if reply.end == "final":
            outputs = {o["name"]: o["data"] for o in json.loads(reply.text)["outputs"]}
            reply.text, reply.finish_reason = outputs["text_output"][0], outputs["finish_reason"][0]
        return reply
    stream = protocol == "http_generate_stream"
    body = triton_body(triton_values(plan, stream=stream), plan.bad)
    path = f"/v2/models/ensemble/{'generate_stream' if stream else 'generate'}"
    if not stream:
        leave = plan.cancel_seconds if plan.kind == "disconnect" else 0
        reply = http.call(path, body, timeout, leave=leave)
        if reply.end == "final":
            out = json.loads(reply.text)
            reply.text, reply.finish_reason = out["text_output"], out["finish_reason"]
        return reply
    reply, events = http.events(path, body, timeout, plan.cancel_after)
    if error := stream_error(events):
        return error
    if reply.end == "final":
        indexes = [e["index"] for e in events]
        reason = events[-1]["finish_reason"] if events else ""
        if indexes != list(range(len(events))) or not reason:
            return Reply("truncated", message=f"indexes {indexes[:20]}, last reason {reason!r}")
        reply.text, reply.finish_reason = "".join(e["text_output"] for e in events), reason
    return reply


def gateway(http: Http, plan: Plan, protocol: str, model: str, timeout: float) -> Reply:
    """openai_completions or openai_chat, with or without _stream."""
    chat = protocol.startswith("openai_chat")
    stream = protocol.endswith("_stream")
    body = gateway_body(plan, model, chat, stream)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = content_type(plan.bad)
    if not stream:
        leave = plan.cancel_seconds if plan.kind == "cancel" else 0
        reply = http.call(path, body, timeout, kind, leave)
        if reply.end == "final":
            choice = json.loads(reply.text)["choices"][0]
            reply.text = choice["message"]["content"] if chat else choice["text"]
            reply.finish_reason = choice["finish_reason"] or ""
        return reply
    reply, events = http.events(path, body, timeout, plan.cancel_after, kind)
    if error := stream_error(events):
        return error
    if reply.end == "final":
        chunks = [e for e in events if isinstance(e, dict)]
        reason = chunks[-1]["choices"][0]["finish_reason"] if chunks else None
        if events[-1:] != ["[DONE]"] or not reason:
            return Reply("truncated", message=f"{len(events)} events, last reason {reason!r}")
        texts = [
            c["choices"][0]["delta"].get("content") or "" if chat else c["choices"][0]["text"]
            for c in chunks
        ]
        reply.text, reply.finish_reason = "".join(texts), reason
    return reply
