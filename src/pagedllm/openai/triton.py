"""One generation from the `ensemble` model over gRPC streaming (`tritonclient.grpc.aio`).

Every generation is one request with `stream=true` on its own bidirectional stream. Stopping
the iteration early (the consumer is cancelled or closes the generator) cancels the gRPC call:
Triton cancels the ensemble request, the detokenizer notices it on the next streamed response
and the engine aborts the request at its next step, freeing its KV blocks (docs/serving.md,
Cancellation).

NOTE: requests are streamed from Triton even when the OpenAI client did not ask for a stream.
A `stream=false` ensemble request sends no response until it ends, so nothing in the pipeline
would notice its cancellation: the engine would run it to the end for a client long gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

logger = logging.getLogger("pagedllm.openai")

# messages of Triton-side failures that are the server's fault, not the request's
_UNAVAILABLE_HINTS = ("unknown model", "is not ready", "not found", "failed to connect")
# the engine refuses a request when its waiting queue is full with a message starting so
# (Triton may put "in ensemble 'ensemble', " before it); over gRPC there is no status code
_BUSY = re.compile(r"(?:^|, )server busy\b", re.I)


class TritonError(Exception):
    """A failed generation: `status` 400 for a request the model refused (our message), 429
    when the engine is too busy to queue it, 500 when the gateway could not send it, 502 when
    Triton's answer is broken, 503 when Triton cannot be reached or cannot serve the model."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Generation:
    """One Triton request: the prompt (text, or token ids sent as `input_ids`) and vLLM-named
    sampling parameters (`logprobs: N` and `prompt_logprobs: N` ask for log-probs with N top
    alternatives per token)."""

    prompt: str | list[int]
    sampling: dict[str, Any]
    # > 1: a beam search (TensorRT-LLM's `beam_width`, `length_penalty`; `openai.beams`)
    beam_width: int = 1
    length_penalty: float = 1.0

    @property
    def logprobs(self) -> bool:
        return self.sampling.get("logprobs") is not None


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probs: its token, the token's log-prob (None for a prompt's first
    token, which nothing predicts), the N most likely tokens there, best first, and the
    token's rank (1: the most likely; known for prompt tokens)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass
class Chunk:
    """One streamed response: the new text, the ids it adds and their log-probs (when asked),
    the prompt's log-probs (first response only, when asked), `finish_reason` ("" until the
    last), cumulative token counts and, on the last, the prompt tokens the prefix cache
    served."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None
    # a beam search: every beam's whole output so far, best first (each a Chunk of its own)
    beams: list[Chunk] | None = None


def _tensor(name: str, datatype: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def make_inputs(generation: Generation) -> list[grpcclient.InferInput]:
    """The request's tensors; TritonError 400 for text that is not valid Unicode (a lone
    surrogate) or a parameter that is not a finite number (the protocol refuses both first)."""

    def text(name: str, value: str) -> np.ndarray:
        try:
            return np.array([value.encode("utf-8")], dtype=np.object_)
        except UnicodeEncodeError as e:
            raise TritonError(400, f"{name} is not valid Unicode ({e.reason})") from None

    def flag(value: bool) -> np.ndarray:
        return np.array([value], dtype=np.bool_)

    try:
        sampling = json.dumps(generation.sampling, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise TritonError(400, "sampling parameters must be finite numbers") from None
    if isinstance(generation.prompt, str):
        prompt = _tensor("text_input", "BYTES", text("the prompt", generation.prompt))
    else:
        prompt = _tensor("input_ids", "INT32", np.array(generation.prompt, dtype=np.int32))
    inputs = [
        prompt,
        _tensor(
            "sampling_parameters", "BYTES", text("sampling_parameters (a stop string)", sampling)
        ),
        _tensor("stream", "BOOL", flag(True)),
        _tensor("exclude_input_in_output", "BOOL", flag(True)),
        _tensor("return_log_probs", "BOOL", flag(generation.logprobs)),
    ]
    if generation.beam_width > 1:
        width = np.array([generation.beam_width], dtype=np.int32)
        penalty = np.array([generation.length_penalty], dtype=np.float32)
        inputs += [
            _tensor("beam_width", "INT32", width),
            _tensor("length_penalty", "FP32", penalty),
        ]
    return inputs


def token_logprobs(
    ids: np.ndarray,
    chosen: np.ndarray,
    top_ids: np.ndarray | None,
    top: np.ndarray | None,
    ranks: np.ndarray | None = None,
) -> list[TokenLogprob]:
    """Positions from Triton's tensors: ids and chosen log-probs (T,), top ids and log-probs
    (T, N) or absent (N = 0), the chosen tokens' ranks (T,) or absent. TritonError 502 when
    their shapes disagree."""
    rows = len(ids)
    if top_ids is None or top is None or top_ids.size == top.size == 0:
        top_ids = top = np.zeros((rows, 0))
    bad_ranks = ranks is not None and len(ranks) != rows
    if (
        len(chosen) != rows
        or top_ids.shape != top.shape
        or top_ids.size % max(rows, 1)
        or bad_ranks
    ):
        shapes = f"{ids.shape}, {chosen.shape}, {top_ids.shape}, {top.shape}"
        logger.error("log-prob tensors of mismatched shapes from Triton: %s", shapes)
        raise TritonError(502, "Triton's log-prob outputs disagree in length")
    if rows == 0:
        return []
    top_ids, top = top_ids.reshape(rows, -1), top.reshape(rows, -1)
    return [
        TokenLogprob(
            int(ids[t]),
            float(chosen[t]),
            tuple((int(i), float(v)) for i, v in zip(top_ids[t], top[t], strict=True)),
            None if ranks is None else int(ranks[t]),
        )
        for t in range(rows)
    ]


def to_chunk(result: Any) -> Chunk:
    def array(name: str) -> np.ndarray:
        value = result.as_numpy(name)
        return np.zeros(0) if value is None else value.reshape(-1)

    def scalar(name: str, default: Any) -> Any:
        value = array(name)
        return value[0] if value.size else default

    text, reason = scalar("text_output", b""), scalar("finish_reason", b"")
    cached = scalar("num_cached_tokens", None)
    ids, chosen = array("output_token_ids"), array("output_log_probs")
    logprobs = []
    if chosen.size:  # asked for: (T,) chosen, (T, N) top
        top_ids, top = map(result.as_numpy, ("output_top_token_ids", "output_top_log_probs"))
        logprobs = token_logprobs(ids, chosen, top_ids, top)
    prompt_logprobs = None
    prompt_ids = array("prompt_token_ids")
    if prompt_ids.size:  # the first response, when asked: (L,) ids, (L-1,) and (L-1, N)
        top_ids, top = map(result.as_numpy, ("prompt_top_token_ids", "prompt_top_log_probs"))
        ranks = result.as_numpy("prompt_ranks")
        ranks = None if ranks is None else ranks.reshape(-1)
        rest = token_logprobs(prompt_ids[1:], array("prompt_log_probs"), top_ids, top, ranks)
        # the first token has no log-prob: nothing predicts it
        prompt_logprobs = [TokenLogprob(int(prompt_ids[0]), None), *rest]
    lengths = result.as_numpy("sequence_lengths")
    return Chunk(
        beams=None if lengths is None else _beams(array, lengths.reshape(-1)),
        text=text.decode("utf-8") if isinstance(text, bytes) else str(text),
        token_ids=[int(i) for i in ids],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        finish_reason=reason.decode() if isinstance(reason, bytes) else str(reason),
        num_input_tokens=int(scalar("num_input_tokens", 0)),
        num_output_tokens=int(scalar("num_output_tokens", 0)),
        num_cached_tokens=None if cached is None else int(cached),
    )


def _beams(array: Any, lengths: np.ndarray) -> list[Chunk]:
    """A beam search's response: one Chunk per beam, its tokens' log-probs included."""
    texts, reasons = array("text_output"), array("finish_reason")
    ids, chosen = array("output_token_ids"), array("output_log_probs")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    beams = []
    for k, (a, b) in enumerate(pairwise(starts)):
        entries = [
            TokenLogprob(int(i), float(v)) for i, v in zip(ids[a:b], chosen[a:b], strict=True)
        ]
        beams.append(
            Chunk(
                text=texts[k].decode("utf-8"),
                token_ids=[int(i) for i in ids[a:b]],
                logprobs=entries,
                finish_reason=reasons[k].decode(),
                num_input_tokens=int(array("num_input_tokens")[0]),
                num_output_tokens=int(b - a),
            )
        )
    return beams


def request_error(message: str) -> TritonError:
    """The TritonError of an error response's message (gRPC streaming carries no code)."""
    lowered = message.lower()
    if _BUSY.search(message):
        return TritonError(429, message)
    status = 503 if any(hint in lowered for hint in _UNAVAILABLE_HINTS) else 400
    return TritonError(status, message)


def _cancelled() -> bool:
    """The running task is being cancelled (not merely seeing a CancelledError)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


class TritonBridge:
    """Streams generations from `model` on the server at `url` (host:port of gRPC). The
    channel is created on first use, in the running event loop."""

    def __init__(self, url: str, model: str = "ensemble") -> None:
        self.url = url
        self.model = model
        self._client: grpcclient.InferenceServerClient | None = None

    def client(self) -> grpcclient.InferenceServerClient:
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def is_ready(self) -> bool:
        """The server is ready and serves `model`."""
        try:
            return bool(await self.client().is_model_ready(self.model))
        except (InferenceServerException, grpc.RpcError):
            return False

    async def generate(self, generation: Generation) -> AsyncIterator[Chunk]:
        """Yield the request's responses up to the one with a finish_reason. Raises
        TritonError, also when the stream ends without that response. Closing the generator
        before the end cancels the request."""
        # NOTE: gRPC only logs what a request iterator raises (at debug level) and cancels the
        # call, so the request is built here, where its errors are raised; and a stream that
        # ends without a final response, or a cancelled call that is not ours, is an error
        request = {"model_name": self.model, "inputs": make_inputs(generation)}
        sent = asyncio.Event()  # the request iterator stays open until the request is over

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            await sent.wait()

        call = None
        finished = False
        try:
            call = self.client().stream_infer(requests())
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise request_error(str(error.message()))
                chunk = to_chunk(result)
                if chunk.finish_reason:
                    finished = True
                    sent.set()  # half-close: Triton ends the stream
                yield chunk
        except grpc.RpcError as e:
            details = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            raise TritonError(503, f"Triton at {self.url} is unavailable: {details}") from None
        except InferenceServerException as e:
            raise TritonError(503, f"Triton at {self.url}: {e.message()}") from None
        except asyncio.CancelledError:
            if _cancelled():
                raise  # our consumer went away
            # gRPC cancelled the call itself: sending the request failed
            logger.error("gRPC cancelled the stream of a request to %s", self.url)
            raise TritonError(500, "the request could not be sent to Triton") from None
        finally:
            sent.set()
            if call is not None and not finished:
                call.cancel()  # Triton cancels the ensemble request, the engine aborts it
        if not finished:
            logger.error("the response stream from %s ended without a final response", self.url)
            raise TritonError(502, "Triton's response stream ended without a final response")
