"""Triton adapter: the engine's window protocol -> text
(`pagedllm.serving.text_models.DetokenizerModel`); reports cancelled requests to the engine."""

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

from pagedllm.serving import adapter  # noqa: E402
from pagedllm.serving.engine_model import model_dir  # noqa: E402
from pagedllm.serving.text_models import DetokenizerModel  # noqa: E402
from pagedllm.text.tokenizer import Tokenizer  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = adapter.parameters(args)
        self.model = DetokenizerModel(Tokenizer.from_model_dir(model_dir(params)))

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors, request_id = self.model.handle(adapter.getter(pb_utils, request))
            if request_id is not None and request.is_cancelled():  # None: not asked this time
                # Triton does not tell the in-flight llm_engine request (DESIGN.md fact 5);
                # the response still goes out, so the ensemble request completes
                self._abort(request_id)
            responses.append(adapter.response(pb_utils, tensors))
        return responses

    @staticmethod
    def _abort(request_id):
        request = pb_utils.InferenceRequest(
            model_name="llm_engine",
            inputs=[
                pb_utils.Tensor(
                    "abort_request_id", np.array([request_id.encode()], dtype=np.object_)
                )
            ],
            requested_output_names=["meta"],
        )
        for _ in request.exec(decoupled=True):  # one empty final response
            pass
