"""TensorRT-LLM's `tensorrt_llm_bls` contract on pagedllm's pipeline, without Triton.

The model.py adapter hands over the request's tensors (`get(name)`, each `[B, ...]`: the
model has a batch dimension, so TensorRT-LLM's clients send `[1, 1]` / `[1, N]`) and an
`Engine` (llm_engine by BLS). Here each batch item becomes its own engine request: tokenized
in process (`TokenizerModel`), its responses detokenized in process (`DetokenizerModel`) and
turned into TensorRT-LLM's outputs, each tagged with `batch_index` when B > 1. TensorRT-LLM's
sampling defaults apply: with neither `top_k` nor `top_p` above 0 it decodes greedily, whatever
the temperature (its top-k kernel turns k = 0, p = 0 into k = 1). `run_engine` is the loop
`tensorrt_llm` (`trtllm_llmapi`) shares.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from pagedllm.lora.request import TASK_INPUTS
from pagedllm.serving import structured
from pagedllm.serving.codec import RequestError, parse_request
from pagedllm.serving.engine_stream import Tensors
from pagedllm.serving.inputs import Getter
from pagedllm.serving.text_models import OPTIONAL, DetokenizerModel, TokenizerModel
from pagedllm.text.tokenizer import Tokenizer

# what is asked of llm_engine: the window protocol, and the optional outputs when sent
ENGINE_OUTPUTS = ["ids", "meta", "strings", "output_log_probs", "output_token_ids", *OPTIONAL]
# TensorRT-LLM inputs passed to llm_engine as they are (its codec knows their names)
FORWARDED = (
    "text_input",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "end_id",
    "pad_id",
    "length_penalty",
    "early_stopping",
    "beam_width",
    "return_context_logits",
    "return_generation_logits",
    "exclude_input_in_output",
    "stream",
    "return_log_probs",
    *structured.GUIDE_INPUTS,
    *TASK_INPUTS,
)
WORD_LISTS = ("stop_words", "bad_words")
# read here, not by the engine
LOCAL = (
    "num_return_sequences",
    "return_perf_metrics",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


@dataclasses.dataclass
class EngineReply:
    """One llm_engine response: its tensors, or its error message."""

    tensors: Tensors | None = None
    error: str | None = None


# inputs -> llm_engine's responses (the empty final one left out)
Engine = Callable[[Tensors], Iterable[EngineReply]]


def engine_caller(pb_utils: Any) -> Engine:
    """llm_engine by BLS, with Triton's Python-backend module `pb_utils` (passed in: it exists
    only inside the stub)."""

    def call(inputs: Tensors) -> Iterator[EngineReply]:
        tensors = [pb_utils.Tensor(n, np.ascontiguousarray(a)) for n, a in inputs.items()]
        request = pb_utils.InferenceRequest(
            model_name="llm_engine", inputs=tensors, requested_output_names=ENGINE_OUTPUTS
        )
        for response in request.exec(decoupled=True):
            if response.has_error():  # its code is lost on the way (errors.error_code)
                yield EngineReply(error=response.error().message())
                continue
            out = {t.name(): t.as_numpy() for t in response.output_tensors()}
            if out:
                yield EngineReply(tensors=out)

    return call


def run_engine(
    inputs: Tensors,
    engine: Engine,
    detokenizer: DetokenizerModel,
    on_output: Callable[[Tensors], None],
    should_abort: Callable[[], bool],
    abort: Callable[[str], None],
) -> str | None:
    """One llm_engine request: each response is detokenized here and handed to `on_output`
    (pagedllm's output set). `should_abort()` is asked on each probe and, while streaming, at
    the `CancelPolls` times; True aborts the engine request once (its final, aborted output
    still follows). Returns the engine's error message, if it sent one."""
    error, aborted = None, False
    for reply in engine(inputs):
        if reply.error is not None or reply.tensors is None:
            error = reply.error
            continue
        out, request_id = detokenizer.handle(reply.tensors.get)
        if request_id is not None and not aborted and should_abort():
            aborted = True
            abort(request_id)
        if out is not None:
            on_output(out)
    return error


def scalar(get: Getter, name: str) -> Any:
    """A one-value tensor's value (None when absent)."""
    array = get(name)
    if array is None:
        return None
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value


def words(get: Getter, name: str) -> np.ndarray | None:
    """A word list without its empty strings (TensorRT-LLM skips them: its clients send
    `[[""]]` for none); None when nothing is left."""
    array = get(name)
    if array is None:
        return None
    kept = [w for w in array.reshape(-1) if w not in (b"", "")]
    return np.array(kept, dtype=np.object_) if kept else None


def trt_greedy(inputs: Tensors) -> None:
    """TensorRT-LLM's rule: top_k <= 0 and top_p <= 0 (or absent) decode greedily; a value <= 0
    is unset."""
    top_k, top_p = scalar(inputs.get, "top_k"), scalar(inputs.get, "top_p")
    if (top_k or 0) <= 0 and (top_p or 0) <= 0:
        inputs["temperature"] = np.array([0.0], dtype=np.float32)
    for name, value in (("top_k", top_k), ("top_p", top_p)):
        if value is not None and value <= 0:
            del inputs[name]


@dataclasses.dataclass
class BlsItem:
    """One batch item of a `tensorrt_llm_bls` request: its llm_engine request and outputs."""

    index: int
    batched: bool  # B > 1: responses carry batch_index
    inputs: Tensors
    stream: bool
    exclude_input: bool
    log_probs: bool
    num_input_tokens: bool
    num_output_tokens: bool


def batch_size(get: Getter, names: Iterable[str]) -> int:
    sizes = {name: a.shape[0] for name in names if (a := get(name)) is not None and a.ndim}
    if "text_input" not in sizes:
        raise RequestError("text_input is required")
    if len(set(sizes.values())) != 1:
        raise RequestError(f"the inputs' batch sizes differ: {sizes}")
    return sizes["text_input"]


class BlsModel:
    """`tensorrt_llm_bls`: TensorRT-LLM's BLS inputs and outputs (docs/serving.md)."""

    def __init__(self, tokenizer: Tokenizer, max_prompt_bytes: int) -> None:
        self.tokenizer = TokenizerModel(tokenizer, max_prompt_bytes)
        self.detokenizer = DetokenizerModel(tokenizer)

    def items(self, get: Getter) -> list[BlsItem]:
        """The request's batch items, each checked and tokenized (a bad item fails the whole
        request before anything runs)."""
        size = batch_size(get, (*FORWARDED, *WORD_LISTS, *LOCAL))
        return [self._item(get, i, size) for i in range(size)]

    def _item(self, get: Getter, index: int, size: int) -> BlsItem:
        def item(name: str) -> np.ndarray | None:
            array = get(name)  # (a copy: the other items run after execute() has returned)
            return None if array is None else array[index].copy()

        n = scalar(item, "num_return_sequences")
        if n not in (None, 1):
            raise RequestError(f"num_return_sequences must be 1 (send n requests), got {n}")
        if scalar(item, "return_perf_metrics"):
            raise RequestError("return_perf_metrics is not supported")
        inputs = {name: a for name in FORWARDED if (a := item(name)) is not None}
        for name in WORD_LISTS:
            if (kept := words(item, name)) is not None:
                inputs[name] = kept
        trt_greedy(inputs)
        request = parse_request(inputs.get)  # its errors now, before any item runs
        if (spec := request.params.structured_outputs) is not None:
            try:  # (the engine would refuse it, but maybe after another item has streamed)
                structured.check(spec)
            except ValueError as e:
                raise RequestError(str(e)) from None
        inputs["input_ids"] = self.tokenizer.handle(inputs.get)["input_ids"]
        return BlsItem(
            index=index,
            batched=size > 1,
            inputs=inputs,
            stream=request.stream,
            exclude_input=request.exclude_input_in_output,
            log_probs=bool(scalar(item, "return_log_probs")),
            num_input_tokens=bool(scalar(item, "return_num_input_tokens")),
            num_output_tokens=bool(scalar(item, "return_num_output_tokens")),
        )

    def run(
        self, item: BlsItem, engine: Engine, replies: BatchReplies, abort: Callable[[str], None]
    ) -> str | None:
        """Run one item to its end, its responses through `replies`; its error message, if any."""

        def on_output(out: Tensors) -> None:
            replies.send(self.tensors(item, out))

        return run_engine(
            item.inputs, engine, self.detokenizer, on_output, replies.cancelled, abort
        )

    @staticmethod
    def tensors(item: BlsItem, out: Tensors) -> Tensors:
        """TensorRT-LLM's outputs of one batch item: `text_output` [beam] as its BLS sends it
        (its postprocessing's 1-D `OUTPUT`), the others [1, ...] as its core model's. A beam
        search (`sequence_lengths` sent: every beam whole, best first) gives [1, beam] counts
        and log-probs, `output_log_probs` [1, beam, tokens] padded with 0 as TensorRT-LLM's."""
        lengths = out.get("sequence_lengths")
        texts = out["text_output"].reshape(-1)
        t: Tensors = {"text_output": texts[: 1 if lengths is None else len(texts)].copy()}
        if item.batched:
            t["batch_index"] = np.array([[item.index]], dtype=np.int32)
        if item.log_probs:  # [1, beam, tokens] and [1, beam]
            chosen = out["output_log_probs"].astype(np.float32)
            t["output_log_probs"] = _per_beam(chosen, lengths)
            total = out.get("cum_log_probs", np.zeros(1, dtype=np.float32))
            t["cum_log_probs"] = total.astype(np.float32).reshape(1, -1)
        prompt = int(out["num_input_tokens"].reshape(-1)[0])
        if item.num_input_tokens:
            t["num_input_tokens"] = np.array([[prompt]], dtype=np.int32)
        if item.num_output_tokens:
            # TensorRT-LLM counts this response's output ids: streamed, the new ones; else all
            # of them, the prompt's included unless excluded (beams: each one's whole output)
            if lengths is not None:
                counts = lengths + (0 if item.exclude_input or item.stream else prompt)
            elif item.stream:
                counts = np.array([len(out["output_token_ids"])])
            else:
                count = int(out["num_output_tokens"].reshape(-1)[0])
                counts = np.array([count + (0 if item.exclude_input else prompt)])
            t["num_output_tokens"] = counts.astype(np.int32).reshape(1, -1)
        return t


def _per_beam(values: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """[1, beam, tokens]: one beam's values, or the beams' (one after another) padded."""
    if lengths is None:
        return values.reshape(1, 1, -1)
    out = np.zeros((1, len(lengths), int(lengths.max(initial=0))), dtype=np.float32)
    start = 0
    for k, n in enumerate(lengths.tolist()):
        out[0, k, :n] = values[start : start + n]
        start += n
    return out


class BatchReplies:
    """One Triton request's responses when each batch item is its own engine request: sends
    are serialized; the first error ends the request (the other items then abort at their
    next cancel check); the final flag goes out alone once every item has ended, as
    TensorRT-LLM's decoupled BLS sends it. The sender is never asked anything after it."""

    def __init__(
        self,
        items: int,
        send: Callable[[Tensors], None],
        fail: Callable[[str, str], None],
        finish: Callable[[], None],
        is_cancelled: Callable[[], bool],
    ) -> None:
        self._pending = items
        self._send, self._fail, self._finish = send, fail, finish
        self._is_cancelled = is_cancelled
        self._closed = False
        self._lock = threading.Lock()

    def send(self, tensors: Tensors) -> None:
        with self._lock:
            if not self._closed:
                self._send(tensors)

    def fail(self, message: str, code: str) -> None:
        """An error response with the final flag (the first one only)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._fail(message, code)

    def cancelled(self) -> bool:
        """The client cancelled, or the request has ended with an error: stop this item."""
        with self._lock:
            return self._closed or self._is_cancelled()

    def item_done(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending == 0 and not self._closed:
                self._closed = True
                self._finish()
