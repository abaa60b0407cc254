"""TensorRT-LLM's LLM-API model contract (`tensorrt_llm`, triton_backend/all_models/llmapi) on
pagedllm's pipeline, without Triton.

As upstream's default (model.yaml `max_batch_size: 0`, `decoupled: False`): one prompt
(`text_input[0]`), one answer, `streaming=true` refused with upstream's error. Sampling comes
from `sampling_param_*` inputs with the LLM API's defaults: `max_tokens` 32, and greedy when
temperature, top_k and top_p are all absent, or when top_k is 1, top_p 0 or temperature 0.
The prompt leads `text_output` unless `sampling_param_exclude_input_from_output`.
Structured outputs: upstream's model has no input for them; this one takes TensorRT-LLM's
`guided_decoding_guide_type` + `guided_decoding_guide`, as its `ensemble` and
`tensorrt_llm_bls` models do (`serving.structured`).

A request with `stop=true` stops every request in flight under the same Triton request id
(upstream: by id, whoever sent it) and is itself answered `CANCELLED` "Request cancelled by
client"; so is the stopped request, and one whose client cancelled (a gRPC cancel or deadline).
NOTE: so any client that can guess a request id (clients choose them: "1" is llmapi_client.py's
default) can stop another's request. `allow_stop=False` (the `stop_by_request_id` parameter)
refuses `stop` instead; clients can still cancel their own requests (gRPC cancel).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable

import numpy as np

from pagedllm.serving import structured
from pagedllm.serving.codec import RequestError
from pagedllm.serving.engine_stream import Tensors
from pagedllm.serving.errors import error_code
from pagedllm.serving.inputs import Getter
from pagedllm.serving.text_models import DetokenizerModel, TokenizerModel
from pagedllm.serving.trtllm import Engine, run_engine, scalar, words
from pagedllm.text.tokenizer import Tokenizer

CANCELLED = "Request cancelled by client"
# upstream's message (its model sends it with "Error generating request: " first)
NOT_DECOUPLED = "Error generating request: Streaming is only supported in decoupled mode."
# sampling_param_<name> -> llm_engine's input (the LLM API's SamplingParams names)
SAMPLING = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "exclude_input_from_output": "exclude_input_in_output",
}
DEFAULT_MAX_TOKENS = 32  # the LLM API's SamplingParams.max_tokens
FLAGS = ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")


@dataclasses.dataclass(eq=False)
class Run:
    """A request in flight, as a stop request finds it by its Triton request id."""

    stopped: bool = False
    cancelled: bool = False


@dataclasses.dataclass
class Answer:
    """The one response: its tensors, or an error with its Triton code."""

    tensors: Tensors | None = None
    error: str | None = None
    code: str = "INVALID_ARG"


@dataclasses.dataclass
class LlmApiRequest:
    inputs: Tensors  # llm_engine's
    stops: list[str]
    flags: dict[str, bool]
    n: int = 1  # outputs returned (the best n of a beam search)


class LlmApiModel:
    def __init__(
        self, tokenizer: Tokenizer, max_prompt_bytes: int, allow_stop: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.allow_stop = allow_stop
        self.tokenize = TokenizerModel(tokenizer, max_prompt_bytes)
        self.detokenizer = DetokenizerModel(tokenizer)
        self._runs: dict[str, set[Run]] = {}  # Triton request id -> its requests in flight
        self._lock = threading.Lock()

    def handle(
        self,
        get: Getter,
        request_id: str,
        engine: Engine,
        is_cancelled: Callable[[], bool],
        abort: Callable[[str], None],
    ) -> Answer:
        """Answer one request (blocks until it has ended)."""
        if scalar(get, "stop"):
            return self.stop(request_id)
        if scalar(get, "streaming"):
            return Answer(error=NOT_DECOUPLED)
        request = self.request(get)
        run = Run()
        outputs: list[Tensors] = []

        def should_abort() -> bool:
            run.cancelled = run.cancelled or is_cancelled()
            return run.stopped or run.cancelled

        self._register(request_id, run)
        try:
            error = run_engine(
                request.inputs, engine, self.detokenizer, outputs.append, should_abort, abort
            )
        finally:
            self._unregister(request_id, run)
        if run.stopped or run.cancelled:
            return Answer(error=CANCELLED, code="CANCELLED")
        if error is not None:
            return Answer(error=error, code=error_code(error))
        if not outputs:
            return Answer(error="tensorrt_llm: the engine sent no response", code="INTERNAL")
        return Answer(tensors=self.tensors(request, outputs[-1]))

    def stop(self, request_id: str) -> Answer:
        """Stop the requests in flight under `request_id` (they abort at the engine's next
        probe, within half a second); answered CANCELLED, whether there were any or not."""
        if not self.allow_stop:
            return Answer(
                error="stop by request id is turned off on this server (stop_by_request_id):"
                " cancel the request instead"
            )
        if not request_id:
            return Answer(error="A request id must be provided for request cancellation")
        with self._lock:
            for run in self._runs.get(request_id, ()):
                run.stopped = True
        return Answer(error=CANCELLED, code="CANCELLED")

    def _register(self, request_id: str, run: Run) -> None:
        if request_id:
            with self._lock:
                self._runs.setdefault(request_id, set()).add(run)

    def _unregister(self, request_id: str, run: Run) -> None:
        if request_id:
            with self._lock:
                runs = self._runs.get(request_id, set())
                runs.discard(run)
                if not runs:
                    self._runs.pop(request_id, None)

    def request(self, get: Getter) -> LlmApiRequest:
        text = get("text_input")
        if text is None or text.size == 0:
            raise RequestError("text_input is missing from the request")
        if text.ndim > 1:
            raise RequestError(
                "The current implementation only supports text_input being a 1D tensor."
            )
        if scalar(get, "sampling_param_return_perf_metrics"):
            raise RequestError("sampling_param_return_perf_metrics is not supported")
        inputs: Tensors = {"text_input": text.reshape(-1)[:1], "stream": np.array([False])}
        for name, engine_name in SAMPLING.items():
            if (array := get(f"sampling_param_{name}")) is not None:
                inputs[engine_name] = array
        inputs.setdefault("max_tokens", np.array([DEFAULT_MAX_TOKENS], dtype=np.int32))
        for name in structured.GUIDE_INPUTS:  # TensorRT-LLM's other models' names
            if (array := get(name)) is not None:
                inputs[name] = array
        stops = words(get, "sampling_param_stop")
        if stops is not None:
            inputs["stop_words"] = stops
        flags = {name: bool(scalar(get, name)) for name in FLAGS}
        if flags["return_cumulative_logprob"]:
            inputs["return_log_probs"] = np.array([True])
        n = llmapi_n(get, inputs)
        llmapi_greedy(inputs)
        inputs["input_ids"] = self.tokenize.handle(inputs.get)["input_ids"]
        texts = [] if stops is None else [_text(s) for s in stops.reshape(-1)]
        return LlmApiRequest(inputs=inputs, stops=texts, flags=flags, n=n)

    def tensors(self, request: LlmApiRequest, out: Tensors) -> Tensors:
        """Upstream's outputs: each [n], one element per output (beams best first)."""
        n = request.n
        t: Tensors = {"text_output": out["text_output"].reshape(-1)[:n].copy()}
        finishes = [_text(f) for f in out["finish_reason"].reshape(-1)[:n]]
        if request.flags["return_finish_reason"]:  # the LLM API's names
            reasons = [{"abort": "cancelled", "": "None"}.get(f, f) for f in finishes]
            t["finish_reason"] = _bytes(*reasons)
        if request.flags["return_stop_reason"]:
            ids = _split(out["output_token_ids"], out.get("sequence_lengths"))
            found = [self._stop_reason(request, i, f) for i, f in zip(ids, finishes, strict=False)]
            t["stop_reason"] = _bytes(*(str(r) for r in found))
        if request.flags["return_cumulative_logprob"]:
            total = out.get("cum_log_probs", np.zeros(n, dtype=np.float32))
            t["cumulative_logprob"] = total.astype(np.float32).reshape(-1)[:n].copy()
        return t

    def _stop_reason(self, request: LlmApiRequest, ids: np.ndarray, finish: str) -> str | None:
        """The stop string that ended an output (the first to occur in its ids' text: the
        engine stops at the earliest); None for EOS, length or an abort."""
        if finish != "stop" or not request.stops:
            return None
        text = self.tokenizer.decode([int(i) for i in ids])
        found = [(text.find(s), k) for k, s in enumerate(request.stops) if s in text]
        return request.stops[min(found)[1]] if found else None


def llmapi_n(get: Getter, inputs: Tensors) -> int:
    """The LLM API's `n`, `best_of` and `use_beam_search` (its SamplingParams): a beam search
    of width `best_of` (else `n`) returning the `n` best beams, with `length_penalty` and
    `early_stopping` (an int, as TensorRT-LLM's: 1 True, 0 False, another value "never");
    or `n` samples. TensorRT-LLM's `beam_width` (its other models' name) is
    `use_beam_search` with `best_of` = `beam_width`. Returns `n`."""
    n = scalar(get, "sampling_param_n")
    n = 1 if n is None else int(n)
    best_of, width = scalar(get, "sampling_param_best_of"), scalar(get, "beam_width")
    beams = bool(scalar(get, "sampling_param_use_beam_search"))
    if width is not None and width != 1:
        if best_of not in (None, width):
            raise RequestError(f"beam_width ({width}) and sampling_param_best_of disagree")
        beams, best_of = True, width
    best_of = n if best_of is None else int(best_of)
    if n < 1 or best_of < n:
        raise RequestError(f"need 1 <= sampling_param_n ({n}) <= sampling_param_best_of")
    if not beams:
        if best_of != n:
            raise RequestError("sampling_param_best_of > n needs sampling_param_use_beam_search")
        if n > 1:
            inputs["num_return_sequences"] = np.array([n], dtype=np.int32)
        return n
    inputs["beam_width"] = np.array([best_of], dtype=np.int32)
    if (penalty := get("sampling_param_length_penalty")) is not None:
        inputs["length_penalty"] = penalty
    stop = scalar(get, "sampling_param_early_stopping")
    if stop is not None:
        value = {1: True, 0: False}.get(int(stop), "never")
        inputs["sampling_parameters"] = np.array([json.dumps({"early_stopping": value})], object)
    return n


def llmapi_greedy(inputs: Tensors) -> None:
    """The LLM API's rule (SamplingParams.params_imply_greedy_decoding)."""
    temperature, top_k, top_p = (scalar(inputs.get, n) for n in ("temperature", "top_k", "top_p"))
    unset = temperature is None and top_k is None and top_p is None
    if unset or top_k == 1 or top_p == 0 or temperature == 0:
        inputs["temperature"] = np.array([0.0], dtype=np.float32)
        inputs.pop("top_k", None)
        inputs.pop("top_p", None)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _bytes(*texts: str) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)


def _split(ids: np.ndarray, lengths: np.ndarray | None) -> list[np.ndarray]:
    """Each output's token ids (the outputs' ids one after another, `lengths` each)."""
    if lengths is None:
        return [ids]
    return np.split(ids.reshape(-1), np.cumsum(lengths.reshape(-1))[:-1])
