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

import json  # noqa: E402

import triton_python_backend_utils as pb_utils  # noqa: E402

from pagedllm.serving.codec import RequestError  # noqa: E402
from pagedllm.serving.engine_model import model_dir  # noqa: E402
from pagedllm.serving.text_models import TokenizerModel  # noqa: E402
from pagedllm.text.tokenizer import Tokenizer  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.model = TokenizerModel(Tokenizer.from_model_dir(model_dir(params)))

    def execute(self, requests):
        responses = []
        for request in requests:

            def get(name, request=request):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            try:
                tensors = self.model.handle(get)
            except RequestError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()]
                )
            )
        return responses
