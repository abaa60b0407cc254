"""What every `model_repository/*/1/model.py` does with Triton's Python-backend objects. The
`pb_utils` module (`triton_python_backend_utils`, which exists only inside the stub) is passed
in, never imported here."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.serving.codec import Getter


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


def error(pb_utils: Any, message: str) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
