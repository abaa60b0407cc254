"""Triton adapter: prompt text -> token ids (`pagedllm.serving.text_models.TokenizerModel`)."""

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
from pagedllm.serving.settings import DEFAULT_MAX_PROMPT_BYTES, int_setting, model_dir  # noqa: E402
from pagedllm.serving.text_models import TokenizerModel  # noqa: E402
from pagedllm.text.tokenizer import Tokenizer  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = adapter.parameters(args)
        self.model = TokenizerModel(
            Tokenizer.from_model_dir(model_dir(params)),
            int_setting(params, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, minimum=1),
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = self.model.handle(adapter.getter(pb_utils, request))
            except RequestError as e:
                responses.append(adapter.error(pb_utils, str(e)))
                continue
            except Exception:
                logging.exception("tokenizer failed")
                responses.append(adapter.error(pb_utils, "tokenizer failed", "INTERNAL"))
                continue
            responses.append(adapter.response(pb_utils, tensors))
        return responses
