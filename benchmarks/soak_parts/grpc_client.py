"""The soak's gRPC client: unary infer on `llm` and streaming on `ensemble`, with cancels (a
short client_timeout, stop_stream(cancel_requests=True) mid-stream)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .plans import Plan, Reply, triton_datatype, triton_values

NUMPY_TYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32}


def grpc_tensors(values: dict[str, Any]) -> list[grpcclient.InferInput]:
    tensors = []
    for name, value in values.items():
        datatype = triton_datatype(value)
        data = value.encode() if isinstance(value, str) else value
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([data], dtype=NUMPY_TYPES[datatype]))
        tensors.append(tensor)
    return tensors


def grpc_error(e: InferenceServerException) -> Reply:
    status = str(e.status() or "")
    return Reply("error", code=status.removeprefix("StatusCode."), message=e.message() or str(e))


class GrpcClient:
    """One worker's gRPC client (one channel): unary infer on `llm` and one stream per request
    on `ensemble` (so that stop_stream(cancel_requests=True) cancels just that request)."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)

    def infer(self, plan: Plan, timeout: float) -> Reply:
        values = triton_values(plan, stream=False)
        deadline = plan.cancel_seconds if plan.kind == "cancel" else timeout
        try:
            result = self.client.infer("llm", grpc_tensors(values), client_timeout=deadline)
        except InferenceServerException as e:
            reply = grpc_error(e)
            if reply.code == "DEADLINE_EXCEEDED":
                reply.end = "cancelled" if plan.kind == "cancel" else "timeout"
            return reply
        return Reply("final", *_outputs(result))

    def stream(self, plan: Plan, stream: bool, timeout: float) -> Reply:
        values = triton_values(plan, stream=stream)
        state = _StreamState(plan.cancel_after if plan.kind == "cancel" else 0)
        self.client.start_stream(callback=state.on_response)
        cancel = True
        try:
            self.client.async_stream_infer(
                "ensemble", grpc_tensors(values), enable_empty_final_response=True
            )
            if plan.kind == "cancel":  # after cancel_after responses, or cancel_seconds
                reached = state.reached.wait(timeout if stream else plan.cancel_seconds)
                if not state.done.is_set():
                    return Reply("timeout" if stream and not reached else "cancelled")
            if not state.done.wait(timeout):
                return Reply("timeout")
            cancel = False
            return state.reply()
        finally:
            self.client.stop_stream(cancel_requests=cancel)

    def close(self) -> None:
        self.client.close()


def _outputs(result: Any) -> tuple[str, str]:
    def item(name: str) -> str:
        value = result.as_numpy(name)
        return "" if value is None else value.reshape(-1)[0].decode("utf-8", "replace")

    return item("text_output"), item("finish_reason")


class _StreamState:
    """The responses of one gRPC stream, collected by its callback thread."""

    def __init__(self, cancel_after: int) -> None:
        self.texts: list[str] = []
        self.indexes: list[int] = []
        self.finish_reason = ""
        self.error: InferenceServerException | None = None
        self.cancel_after = cancel_after
        self.done = threading.Event()
        self.reached = threading.Event()  # cancel_after responses have arrived, or the end

    def on_response(self, result: Any, error: Any) -> None:
        if self.done.is_set():
            return  # after the end: the cancel's own error
        if error is not None:
            self.error = error
            self._end()
            return
        if len(result.get_response().outputs):
            text, self.finish_reason = _outputs(result)
            self.texts.append(text)
            self.indexes.append(int(result.as_numpy("index").reshape(-1)[0]))
            if len(self.texts) == self.cancel_after:
                self.reached.set()
        if result.get_response().parameters["triton_final_response"].bool_param:
            self._end()

    def _end(self) -> None:
        self.done.set()
        self.reached.set()

    def reply(self) -> Reply:
        if self.error is not None:
            return grpc_error(self.error)
        if self.indexes != list(range(len(self.indexes))) or not self.finish_reason:
            return Reply("truncated", message=f"indexes {self.indexes[:20]}")
        return Reply("final", "".join(self.texts), self.finish_reason)
