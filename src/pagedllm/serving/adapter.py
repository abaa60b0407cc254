"""What every `model_repository/*/1/model.py` does with Triton's Python-backend objects. The
`pb_utils` module (`triton_python_backend_utils`, which exists only inside the stub) is passed
in, never imported here."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pagedllm.serving.inputs import Getter


def parameters(args: dict[str, Any]) -> dict[str, str]:
    """The model's config.pbtxt `parameters`, from `initialize(args)`."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def getter(pb_utils: Any, request: Any) -> Getter:
    """`get(name)`: the request's input tensor as a numpy array, or None."""

    def get(name: str) -> Any:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return get


def response(pb_utils: Any, tensors: dict[str, Any]) -> Any:
    """An InferenceResponse carrying `tensors` (name -> numpy array)."""
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, value) for name, value in tensors.items()]
    )


def error(pb_utils: Any, message: str, code: str = "INVALID_ARG") -> Any:
    """An error response. `code`: a `pb_utils.TritonError` code — INVALID_ARG (the request's
    fault: HTTP 400, gRPC INVALID_ARGUMENT), UNAVAILABLE (503), INTERNAL (500, a server
    fault only)."""
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    )


def abort_engine_request(pb_utils: Any, request_id: str) -> None:
    """Ask `llm_engine` to abort the request with this id (the key from its `strings`)."""
    key = np.array([request_id.encode()], dtype=np.object_)
    request = pb_utils.InferenceRequest(
        model_name="llm_engine",
        inputs=[pb_utils.Tensor("abort_request_id", key)],
        requested_output_names=["meta"],
    )
    for _ in request.exec(decoupled=True):  # one empty final response
        pass
