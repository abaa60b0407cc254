"""Triton adapter: the non-decoupled entry point. Plain KServe v2 `infer` (HTTP) and unary
gRPC `ModelInfer` cannot reach a decoupled model; this one runs the ensemble's pipeline
itself: tokenizes in process, calls `llm_engine` (BLS) with stream=false, and detokenizes the
one answer in process (`pagedllm.serving.text_models`). Talking to the engine directly lets it
cancel: on each of the engine's probes it asks Triton whether its own client has gone (gRPC
cancels and deadlines are reported; HTTP disconnects are not, upstream) and aborts the engine
request. execute() only hands each request to a thread, so requests run concurrently and are
batched by the engine."""

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

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from pagedllm.serving import adapter, request_params  # noqa: E402
from pagedllm.serving.codec import RequestError  # noqa: E402
from pagedllm.serving.embedding_codec import (  # noqa: E402
    llm_embedding_outputs,
    llm_embedding_request,
)
from pagedllm.serving.errors import error_code  # noqa: E402
from pagedllm.serving.settings import (  # noqa: E402
    DEFAULT_MAX_PROMPT_BYTES,
    int_setting,
    model_dir,
    setting,
)
from pagedllm.serving.text_models import OPTIONAL, DetokenizerModel, TokenizerModel  # noqa: E402
from pagedllm.text.tokenizer import Tokenizer  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENGINE_OUTPUTS = [
    "ids",
    "meta",
    "strings",
    "output_log_probs",
    "output_token_ids",
    *OPTIONAL,  # sent only when asked for
]


class TritonPythonModel:
    def initialize(self, args):
        params = adapter.parameters(args)
        tokenizer = Tokenizer.from_model_dir(model_dir(params))
        limit = int_setting(params, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, minimum=1)
        self.tokenizer = TokenizerModel(tokenizer, limit)
        self.detokenizer = DetokenizerModel(tokenizer)
        self.pool = ThreadPoolExecutor(max_workers=512, thread_name_prefix="llm")
        self.pooling = setting(params, "runner", "generate") == "pooling"

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._run, request, request.get_response_sender())
        return None

    def _run(self, request, sender):
        try:
            result = self._generate(request)
        except RequestError as e:
            result = adapter.error(pb_utils, str(e))
        except Exception:  # a server fault: this request's error, not the server's
            logging.exception("llm failed")
            result = adapter.error(pb_utils, "llm: internal error", "INTERNAL")
        sender.send(result, flags=FINAL)

    def _generate(self, request):
        get = adapter.getter(pb_utils, request)
        if self.pooling or get("embedding_request") is not None:
            return self._embed(get)
        # request parameters (vllm_backend's sampling parameters) travel as inputs
        replaced = request_params.as_inputs(request_params.parse(request.parameters()), get)
        ids = self.tokenizer.handle(get)["input_ids"]
        replaced |= {"stream": np.array([False]), "input_ids": ids}
        inputs = [t for t in request.inputs() if t.name() not in replaced]
        inputs += [pb_utils.Tensor(name, value) for name, value in replaced.items()]
        engine = pb_utils.InferenceRequest(
            model_name="llm_engine", inputs=inputs, requested_output_names=ENGINE_OUTPUTS
        )
        result = None
        for response in engine.exec(decoupled=True):
            if response.has_error():  # its code is lost on the way: read it from the message
                message = response.error().message()
                result = adapter.error(pb_utils, message, error_code(message))
                continue
            tensors = {t.name(): t.as_numpy() for t in response.output_tensors()}
            if not tensors:  # the empty final response
                continue
            out, request_id = self.detokenizer.handle(tensors.get)
            if out is None:  # a probe: has our client gone?
                if request.is_cancelled():
                    adapter.abort_engine_request(pb_utils, request_id)
                continue
            result = adapter.response(pb_utils, out)
        return result or adapter.error(pb_utils, "llm: the engine sent no response", "INTERNAL")

    def _embed(self, get):
        inputs = [pb_utils.Tensor("embedding_request", llm_embedding_request(get))]
        engine = pb_utils.InferenceRequest(
            model_name="llm_engine",
            inputs=inputs,
            requested_output_names=[
                "text_output",
                "embedding",
                "num_input_tokens",
                "num_output_tokens",
            ],
        )
        result = None
        for response in engine.exec(decoupled=True):  # one response, then the empty final
            if response.has_error():
                message = response.error().message()
                result = adapter.error(pb_utils, message, error_code(message))
                continue
            tensors = {t.name(): t.as_numpy() for t in response.output_tensors()}
            if tensors:
                result = adapter.response(pb_utils, llm_embedding_outputs(get, tensors))
        return result or adapter.error(pb_utils, "llm: the engine sent no response", "INTERNAL")

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=False)
