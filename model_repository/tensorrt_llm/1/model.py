"""Triton adapter: TensorRT-LLM's LLM-API model contract (`tensorrt_llm`: sampling_param_*
inputs, unary, `stop` by request id) on the same pipeline as `llm` (tokenize in process,
llm_engine by BLS, detokenize in process); the work is `pagedllm.serving.trtllm_llmapi`.
execute() only hands each request to a thread, so requests run concurrently (a stop request
reaches the one it stops) and are batched by the engine."""

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
import logging  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import triton_python_backend_utils as pb_utils  # noqa: E402

from pagedllm.convert import to_bool  # noqa: E402
from pagedllm.serving import adapter, request_params  # noqa: E402
from pagedllm.serving.codec import RequestError  # noqa: E402
from pagedllm.serving.settings import (  # noqa: E402
    DEFAULT_MAX_PROMPT_BYTES,
    int_setting,
    model_dir,
    setting,
)
from pagedllm.serving.trtllm import engine_caller  # noqa: E402
from pagedllm.serving.trtllm_llmapi import LlmApiModel  # noqa: E402
from pagedllm.text.tokenizer import Tokenizer  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params = adapter.parameters(args)
        limit = int_setting(params, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, minimum=1)
        allow_stop = to_bool("stop_by_request_id", setting(params, "stop_by_request_id", "true"))
        self.model = LlmApiModel(Tokenizer.from_model_dir(model_dir(params)), limit, allow_stop)
        self.engine = engine_caller(pb_utils)
        self.pool = ThreadPoolExecutor(max_workers=512, thread_name_prefix="trtllm")

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._run, request, request.get_response_sender())
        return None

    def _run(self, request, sender):
        try:
            params = request_params.parse(request.parameters())
            # llmapi_client.py sends Streaming (upstream ignores it; so does this model)
            request_params.check(params, ("Streaming",), "tensorrt_llm")
            answer = self.model.handle(
                adapter.getter(pb_utils, request),
                request.request_id(),
                self.engine,
                request.is_cancelled,
                self._abort,
            )
            if answer.error is None:
                result = adapter.response(pb_utils, answer.tensors)
            else:
                result = adapter.error(pb_utils, answer.error, answer.code)
        except RequestError as e:
            result = adapter.error(pb_utils, str(e))
        except Exception:  # a server fault: this request's error, not the server's
            logging.exception("tensorrt_llm failed")
            result = adapter.error(pb_utils, "tensorrt_llm: internal error", "INTERNAL")
        sender.send(result, flags=FINAL)

    @staticmethod
    def _abort(request_id):
        adapter.abort_engine_request(pb_utils, request_id)

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=False)
