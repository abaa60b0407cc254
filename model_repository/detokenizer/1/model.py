"""Triton adapter: the engine's window protocol -> text
(`pagedllm.serving.text_models.DetokenizerModel`); reports cancelled requests to the engine.
Decoupled so that it can answer a probe with no response at all (a final flag only): the
ensemble's client sees nothing of it."""

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

import triton_python_backend_utils as pb_utils  # noqa: E402

from pagedllm.serving import adapter  # noqa: E402
from pagedllm.serving.codec import RequestError  # noqa: E402
from pagedllm.serving.settings import model_dir  # noqa: E402
from pagedllm.serving.text_models import DetokenizerModel  # noqa: E402
from pagedllm.text.tokenizer import Tokenizer  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params = adapter.parameters(args)
        self.model = DetokenizerModel(Tokenizer.from_model_dir(model_dir(params)))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors, request_id = self.model.handle(adapter.getter(pb_utils, request))
            except RequestError as e:  # a direct caller's bad tensors
                sender.send(adapter.error(pb_utils, str(e)), flags=FINAL)
                continue
            except Exception:
                logging.exception("detokenizer failed")
                sender.send(adapter.error(pb_utils, "detokenizer failed", "INTERNAL"), flags=FINAL)
                continue
            if request_id is not None and request.is_cancelled():  # None: not asked this time
                # Triton does not tell the in-flight llm_engine request (DESIGN.md fact 5);
                # the response still goes out, so the ensemble request completes
                adapter.abort_engine_request(pb_utils, request_id)
            if tensors is None:  # a probe
                sender.send(flags=FINAL)
            else:
                sender.send(adapter.response(pb_utils, tensors), flags=FINAL)
        return None
