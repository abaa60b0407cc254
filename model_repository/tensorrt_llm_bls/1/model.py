"""Triton adapter: TensorRT-LLM's `tensorrt_llm_bls` contract on the same pipeline as `llm`
(tokenize in process, llm_engine by BLS, detokenize in process), one engine request per batch
item; the work is `pagedllm.serving.trtllm`. Decoupled: streamed, one response per token;
the final flag comes alone after the last item's last response (as TensorRT-LLM's BLS sends
it). A cancelled client aborts the engine requests. execute() only hands each request to a
thread, so requests run concurrently and are batched by the engine."""

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

from pagedllm.serving import adapter, request_params  # noqa: E402
from pagedllm.serving.codec import RequestError  # noqa: E402
from pagedllm.serving.errors import error_code  # noqa: E402
from pagedllm.serving.settings import DEFAULT_MAX_PROMPT_BYTES, int_setting, model_dir  # noqa: E402
from pagedllm.serving.trtllm import BatchReplies, BlsModel, engine_caller  # noqa: E402
from pagedllm.text.tokenizer import Tokenizer  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params = adapter.parameters(args)
        limit = int_setting(params, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, minimum=1)
        self.model = BlsModel(Tokenizer.from_model_dir(model_dir(params)), limit)
        self.engine = engine_caller(pb_utils)
        # one thread per batch item in flight (none waits for another: no deadlock when full)
        self.pool = ThreadPoolExecutor(max_workers=512, thread_name_prefix="trtllm-bls")

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._start, request, request.get_response_sender())
        return None

    def _start(self, request, sender):
        try:
            params = request_params.parse(request.parameters())
            request_params.check(params, (), "tensorrt_llm_bls")  # TensorRT-LLM's: none
            items = self.model.items(adapter.getter(pb_utils, request))
        except RequestError as e:
            sender.send(adapter.error(pb_utils, str(e)), flags=FINAL)
            return
        except Exception:
            logging.exception("tensorrt_llm_bls failed")
            sender.send(
                adapter.error(pb_utils, "tensorrt_llm_bls: internal error", "INTERNAL"), flags=FINAL
            )
            return
        replies = BatchReplies(
            len(items),
            send=lambda tensors: sender.send(adapter.response(pb_utils, tensors)),
            fail=lambda message, code: sender.send(
                adapter.error(pb_utils, message, code), flags=FINAL
            ),
            finish=lambda: sender.send(flags=FINAL),
            is_cancelled=sender.is_cancelled,
        )
        for item in items[1:]:
            self.pool.submit(self._run, item, replies)
        self._run(items[0], replies)

    def _run(self, item, replies):
        try:
            error = self.model.run(item, self.engine, replies, self._abort)
            if error is not None:
                replies.fail(error, error_code(error))
        except Exception:
            logging.exception("tensorrt_llm_bls failed")
            replies.fail("tensorrt_llm_bls: internal error", "INTERNAL")
        finally:
            replies.item_done()

    @staticmethod
    def _abort(request_id):
        adapter.abort_engine_request(pb_utils, request_id)

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=False)
