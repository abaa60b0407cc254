"""gRPC requests through tritonclient for the server tests: typed input tensors, and one
streaming request whose responses are collected (or cancelled the way a client does)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from pagedllm.serving.tritonserver import TritonServer


def grpc_inputs(values: dict[str, Any]) -> list[Any]:
    """One [1] tensor per value (str/bytes BYTES, bool BOOL, int INT32, float FP32), a list of
    strings as a BYTES list, a numpy array as it is."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in values.items():
        if isinstance(value, np.ndarray):  # as it is, typed by its dtype
            arr, dtype = value, np_to_triton_dtype(value.dtype)
        elif isinstance(value, list):  # words: a BYTES list
            arr, dtype = np.array([w.encode() for w in value], dtype=np.object_), "BYTES"
        elif isinstance(value, str | bytes):
            raw = value.encode() if isinstance(value, str) else value
            arr, dtype = np.array([raw], dtype=np.object_), "BYTES"
        elif isinstance(value, bool):
            arr, dtype = np.array([value], dtype=np.bool_), "BOOL"
        elif isinstance(value, int):
            arr, dtype = np.array([value], dtype=np.int32), "INT32"
        else:
            arr, dtype = np.array([value], dtype=np.float32), "FP32"
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


class GrpcStream:
    """One streaming request through tritonclient; responses are collected with arrival
    times. `cancel()` cancels it the way a client does (stop_stream(cancel_requests=True))."""

    def __init__(
        self,
        server: TritonServer,
        values: dict[str, Any],
        send: bool = True,
        model: str = "ensemble",
    ) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.model = model
        self.received = 0  # responses of any model, with or without these outputs
        self.responses: list[tuple[float, dict[str, Any]]] = []
        self.error: Any = None
        self.done = threading.Event()
        self.client.start_stream(callback=self._on_response)
        self.inputs = grpc_inputs({"stream": True, **values})
        if send:
            self.send()

    def send(self) -> None:
        self.client.async_stream_infer(self.model, self.inputs, enable_empty_final_response=True)

    def _on_response(self, result: Any, error: Any) -> None:
        if error is not None:
            self.error = error
            self.done.set()
            return
        self.received += 1
        out: dict[str, Any] = {}
        for name in ("text_output", "finish_reason", "index", "num_output_tokens"):
            value = result.as_numpy(name)
            if value is not None:
                item = value.reshape(-1)[0]
                out[name] = item.decode() if isinstance(item, bytes) else int(item)
        if out:
            self.responses.append((time.monotonic(), out))
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.done.set()

    def wait(self, timeout: float = 120) -> str:
        assert self.done.wait(timeout), "stream did not finish"
        self.client.stop_stream()
        assert self.error is None, self.error
        indexes = [r["index"] for _, r in self.responses]
        assert indexes == list(range(len(indexes)))  # in order, none lost
        return "".join(r["text_output"] for _, r in self.responses)

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
