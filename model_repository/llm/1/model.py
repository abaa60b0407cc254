"""Triton adapter: the non-decoupled entry point. Plain KServe v2 `infer` (HTTP) and unary
gRPC `ModelInfer` cannot reach a decoupled model; this one calls `ensemble` (BLS) with
stream=false and returns its single response. execute() only hands each request to a thread,
so requests run concurrently and are batched by the engine."""

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
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from pagedllm.serving import adapter  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
OUTPUTS = ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens"]
OUTPUTS += ["output_log_probs", "output_token_ids", "queue_time_ms", "time_to_first_token_ms"]


class TritonPythonModel:
    def initialize(self, args):
        self.pool = ThreadPoolExecutor(max_workers=512, thread_name_prefix="llm")

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._run, request, request.get_response_sender())
        return None

    @staticmethod
    def _run(request, sender):
        try:
            inputs = [t for t in request.inputs() if t.name() != "stream"]
            inputs.append(pb_utils.Tensor("stream", np.array([False])))
            bls = pb_utils.InferenceRequest(
                model_name="ensemble", inputs=inputs, requested_output_names=OUTPUTS
            )
            result = None
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    result = pb_utils.InferenceResponse(error=response.error())
                elif response.output_tensors():  # skip the empty final one
                    result = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
            if result is None:
                result = adapter.error(pb_utils, "no response")
        except Exception as e:  # any failure is this request's error, not the server's
            result = adapter.error(pb_utils, f"llm: {e}")
        sender.send(result, flags=FINAL)

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=False)
