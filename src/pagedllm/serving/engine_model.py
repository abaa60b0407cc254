"""Everything the Triton `llm_engine` model does, without Triton: the model.py adapter only
converts tensors and calls this. Requests are parsed (`codec`), run by the `EngineService`,
and each output becomes a plain dict of response values handed to a `send` callback."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.engine.service import EngineService
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, to_bool
from pagedllm.serving.codec import Getter, RequestError, parse_request

# send(values, final) / fail(message): the adapter turns them into Triton responses
Send = Callable[[dict[str, Any], bool], None]
Fail = Callable[[str], None]
IsCancelled = Callable[[], bool]


def engine_config(parameters: dict[str, str]) -> EngineConfig:
    """From config.pbtxt parameters; PAGEDLLM_<NAME> environment variables override them."""

    def get(name: str, default: str) -> str:
        return os.environ.get(f"PAGEDLLM_{name.upper()}") or parameters.get(name) or default

    model_dir = get("model_dir", "")
    if not model_dir:
        from pagedllm.prepare import prepare_smollm2

        model_dir = str(prepare_smollm2())
    return EngineConfig.create(
        model_dir,
        dtype=get("dtype", "auto"),
        max_num_seqs=int(get("max_num_seqs", "64")),
        max_model_len=int(get("max_model_len", "0")) or None,  # 0: the model's context
        kv_cache_memory=int(float(get("kv_cache_memory_gib", "2")) * (1 << 30)),
        enable_prefix_caching=to_bool(
            "enable_prefix_caching", get("enable_prefix_caching", "true")
        ),
    )


class EngineModel:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.service = EngineService(self.engine).start()
        self._ids = itertools.count()

    def handle(self, get: Getter, send: Send, fail: Fail, is_cancelled: IsCancelled) -> None:
        """Start one request; responses arrive through `send` from the engine thread."""
        try:
            req = parse_request(get)
        except RequestError as e:
            fail(str(e))
            return
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = dataclasses.replace(req.params, output_kind=kind)
        request_id = f"triton-{next(self._ids)}"
        counter = itertools.count()
        num_output = [0]  # DELTA outputs carry the new token ids only
        prefix = "" if req.stream or req.exclude_input_in_output else req.prompt

        def on_output(out: RequestOutput) -> None:
            if not out.finished and is_cancelled():
                self.service.abort(request_id)
                return
            num_output[0] += len(out.outputs[0].token_ids)
            send(self._values(out, next(counter), prefix, num_output[0]), out.finished)

        self.service.submit(request_id, req.prompt, params, on_output, lambda e: fail(str(e)))

    @staticmethod
    def _values(out: RequestOutput, index: int, prefix: str, num_output: int) -> dict[str, Any]:
        completion = out.outputs[0]
        return {
            "text_output": prefix + completion.text,
            "finish_reason": completion.finish_reason or "",
            "num_input_tokens": len(out.prompt_token_ids),
            "num_output_tokens": num_output,
            "index": index,
        }

    def shutdown(self) -> None:
        self.service.shutdown(drain=False, timeout=30)
