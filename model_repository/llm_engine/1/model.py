"""Triton adapter: tensors <-> plain Python; the work is `pagedllm.serving.engine_model`."""

import os
import site
import sys

# The stub embeds Python in isolated mode (PYTHONPATH is ignored): the launcher lists the
# environment's site directories in PAGEDLLM_SYS_PATH; they go ahead of the system's.
_before = list(sys.path)
for _p in os.environ.get("PAGEDLLM_SYS_PATH", "").split(os.pathsep):
    if _p:
        site.addsitedir(_p)
sys.path[:] = [p for p in sys.path if p not in _before] + _before

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from pagedllm.serving.engine_model import EngineModel, engine_config  # noqa: E402


def _tensor(name, value):
    if isinstance(value, str):
        return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))
    return pb_utils.Tensor(name, np.array([value], dtype=np.int32))


class TritonPythonModel:
    def initialize(self, args):
        import json

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.model = EngineModel(engine_config(params))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()

            def get(name, request=request):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            def send(values, final, sender=sender):
                response = pb_utils.InferenceResponse(
                    output_tensors=[_tensor(k, v) for k, v in values.items()]
                )
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
                sender.send(response, flags=flags)

            def fail(message, sender=sender):
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )

            self.model.handle(get, send, fail, sender.is_cancelled)
        return None

    def finalize(self):
        self.model.shutdown()
