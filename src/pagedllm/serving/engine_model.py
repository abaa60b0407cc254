"""Everything the Triton `llm_engine` model does, without Triton: the model.py adapter only
converts tensors and calls this. Requests are parsed (`codec`), run by the `EngineService`,
and each output becomes a dict of numpy arrays (the response's tensors) handed to a `send`
callback.

Responses speak the window protocol to the `detokenizer` (`engine_stream`).

Probes: a request that has had no response for `PROBE_INTERVAL` (queued, or not streamed: a
non-streamed request answers only at its end) gets a *probe* — a response with `meta.probe`
set and nothing else — so that the step after this one sees the request and can ask Triton
whether its client has gone (the detokenizer drops probes; the `llm` model reads them): a
client that leaves costs at most `PROBE_INTERVAL` plus one step of compute.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np

from pagedllm.beam_search import BeamSearchSequence
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.engine.faults import FaultInjection
from pagedllm.engine.service import EngineService, OnBeams, OnStats
from pagedllm.lora.slots import check_request
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.serving import lora_admin, request_params
from pagedllm.serving.beams import beam_output
from pagedllm.serving.cancel_polls import CancelPolls
from pagedllm.serving.codec import RequestError, parse_request
from pagedllm.serving.engine_stream import Fail, IsCancelled, Send, Stream
from pagedllm.serving.errors import Code, error_code
from pagedllm.serving.inputs import Getter
from pagedllm.serving.lora import LoRANames
from pagedllm.serving.lora_tasks import LoraTasks, Task
from pagedllm.serving.settings import DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_QUEUED_REQUESTS

logger = logging.getLogger(__name__)

# seconds without a response after which a live request gets a probe
PROBE_INTERVAL = 0.5


class EngineModel:
    def __init__(
        self,
        config: EngineConfig,
        on_stats: OnStats | None = None,
        trace_file: str | None = None,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        on_rejected: Callable[[], None] | None = None,
        on_dead: Callable[[str], None] | None = None,
        fault_injection: str = "",
        stopping: Callable[[], bool] | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        """`on_stats` (optional, called on the engine thread) feeds metrics (None: the engine
        records none); `trace_file`: request-lifecycle events, one JSON object per line;
        `max_queued_requests`: requests accepted beyond the `max_num_seqs` that run at once
        (more are refused at once with UNAVAILABLE; `on_rejected` counts them); `on_dead`:
        called once, with the reason, when the engine is poisoned (`engine.faults`; every
        request is refused from then on); `fault_injection`: a test hook, "" in production;
        `stopping`: True once the server is stopping or unloading this model — then new
        requests are refused (UNAVAILABLE), and those in flight get `drain_timeout` seconds to
        finish before they are aborted (so the server's own exit timeout is never reached);
        `lora_modules`: the adapters requests may name (`serving.lora`), each read and checked
        now: a bad one stops the start."""
        self.engine = LLMEngine(
            config,
            metrics=on_stats is not None,
            trace_file=trace_file,
            fault_injection=FaultInjection.parse(fault_injection),
        )
        # the grammar engine reads the vocabulary now, not with the first constrained request
        self.engine.grammar_compiler()
        self.loras = LoRANames(config.lora is not None, lora_modules or {})
        for lora in self.loras.requests.values():
            check_request(self.engine.runner.lora, lora)
        # TensorRT-LLM's lora_task_id; the running requests' tasks (stream id -> task)
        self.tasks = LoraTasks(
            self.engine.runner.lora, config.tensor_parallel_size, self.loras.new_id
        )
        self._task_of: dict[str, Task] = {}
        self._on_dead = on_dead
        self._stopping = stopping
        self.drain_timeout = drain_timeout
        self._drain_deadline: float | None = None  # set when the server stops
        self._drained: set[str] = set()  # aborted at the deadline
        self.service = EngineService(self.engine, on_stats).start()
        self.max_in_flight = config.scheduler.max_num_seqs + max_queued_requests
        self._on_rejected = on_rejected
        self._in_flight = 0  # accepted and not yet answered finally
        self._lock = threading.Lock()
        # Responses are built and sent on their own thread, in order: a send is an IPC round
        # trip to the server, and the engine thread goes on with the next step meanwhile. The
        # live requests (`_live`) belong to that thread: the probes are sent from it too.
        self._outbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._live: dict[str, Stream] = {}
        self._sender = threading.Thread(target=self._send_loop, name="pagedllm-send", daemon=True)
        self._sender.start()
        self._cancel_polls = CancelPolls()

    def handle(
        self,
        get: Getter,
        send: Send,
        fail: Fail,
        is_cancelled: IsCancelled,
        parameters: str = "",
    ) -> None:
        """Start one request; responses arrive through `send` from the sender thread.
        `parameters`: its Triton request parameters, JSON text (`request_params`)."""
        try:
            req = parse_request(get, request_params.parse(parameters))
            lora = self.loras.resolve(req.lora_name)
            by_task = get("lora_task_id") is not None
            if lora is not None and by_task:
                raise RequestError("send lora_name or lora_task_id, not both")
            if (lora is not None or by_task) and req.beam is not None:
                raise RequestError("beam search with a LoRA adapter is not supported")
        except RequestError as e:
            fail(str(e), "INVALID_ARG")
            return
        except Exception:
            logger.exception("reading a request failed")
            fail("internal error reading the request", "INTERNAL")
            return
        if self._drain_deadline is not None:
            fail("the engine is shutting down: no new requests", "UNAVAILABLE")
            return
        try:  # logit_bias, allowed_token_ids: ids of this model's vocabulary
            req.params.check_token_ids(self.engine.config.model.vocab_size)
        except ValueError as e:
            fail(str(e), "INVALID_ARG")
            return
        if req.params.structured_outputs is not None:
            try:  # compiled on the request's thread: no engine step waits for it
                self.engine.grammar_compiler().compile(req.params.structured_outputs)
            except ValueError as e:
                fail(str(e), "INVALID_ARG")
                return
        try:  # the last check: from here on the task counts a request in flight
            task = self.tasks.resolve(get)
        except RequestError as e:
            fail(str(e), "INVALID_ARG")
            return
        if task is not None:
            lora = task.request
        if not self._admit():
            if task is not None:
                self.tasks.release(task)
            fail(
                f"server busy: {self.max_in_flight} requests are in flight"
                " (max_num_seqs + max_queued_requests); retry later",
                "UNAVAILABLE",
            )
            return
        detokenized = bool(req.params.stop) or req.params.n > 1 or req.beam is not None
        prefix = "" if req.stream or req.exclude_input_in_output else req.prompt
        ids = req.prompt_token_ids
        if not (req.stream or req.exclude_input_in_output or prefix) and ids is not None:
            # ids alone: their text leads the output
            prefix = self.engine.tokenizer.decode(ids, req.params.skip_special_tokens)
        params = dataclasses.replace(
            req.params,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            detokenize=detokenized,
        )
        stream = Stream(
            request_id=secrets.token_hex(16),  # unguessable: the key to abort this request
            include_stop_token=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            detokenized=detokenized,
            streamed=req.stream,
            n=req.params.n if req.beam is None else req.beam.beam_width,
            beams=req.beam is not None,
            prefix=prefix,
            send=send,
            fail=fail,
            is_cancelled=is_cancelled,
            return_timing=req.return_timing,
            extra=int(req.extra),
            top_logprobs=req.top_logprobs,
            prompt_top=params.prompt_logprobs or 0,
            polled=not req.downstream_cancel_check,
        )
        if task is not None:
            self._task_of[stream.request_id] = task
        self._outbox.put(lambda: self._live.__setitem__(stream.request_id, stream))

        def on_output(out: RequestOutput) -> None:
            self._outbox.put(lambda: self._respond(stream, out))

        def on_error(e: Exception) -> None:
            message = str(e)
            if not isinstance(e, ValueError) and error_code(message) == "INVALID_ARG":
                message = f"internal error: {message}"  # not the request's fault
            self._outbox.put(lambda: self._fail(stream, message, error_code(message)))

        prompt = req.prompt if req.prompt_token_ids is None else req.prompt_token_ids
        try:
            if req.beam is not None:
                on_beams = self._beam_sender(stream, prompt, params.skip_special_tokens)
                self.service.submit_beam_search(
                    stream.request_id, prompt, req.beam, on_beams, on_error
                )
            else:
                self.service.submit(
                    stream.request_id, prompt, params, on_output, on_error, lora_request=lora
                )
        except RuntimeError as e:  # shutting down, or the engine is dead
            message = str(e) if error_code(str(e)) == "UNAVAILABLE" else f"the engine {e}"
            self._outbox.put(lambda: self._fail(stream, message, "UNAVAILABLE"))

    def _beam_sender(self, stream: Stream, prompt: str | list[int], skip: bool) -> OnBeams:
        """The beams' updates, decoded and sent on the sender thread (`serving.beams`)."""
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

        def on_beams(sequences: list[BeamSearchSequence], finished: bool) -> None:
            if not (finished or stream.streamed):  # a non-streamed request answers once
                return

            def respond() -> None:
                tokenizer = self.engine.tokenizer
                out = beam_output(stream.request_id, ids, sequences, finished, tokenizer, skip)
                self._respond(stream, out)

            self._outbox.put(respond)

        return on_beams

    def _admit(self) -> bool:
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                admitted = False
            else:
                self._in_flight += 1
                admitted = True
        if not admitted and self._on_rejected is not None:
            self._on_rejected()
        return admitted

    # --- on the sender thread ---------------------------------------------------------------

    def _respond(self, stream: Stream, out: RequestOutput) -> None:
        # direct clients of this model: a cancelled stream is seen here (never ask a sender
        # after its final response: the server does not survive it); the ensemble's clients
        # are the detokenizer's to watch
        due = stream.polled and self._cancel_polls.due(stream.request_id, out.finished)
        if due and stream.is_cancelled():
            self._cancel_polls.forget(stream.request_id)
            self.cancelled(stream.request_id)  # its final (abort) output follows
            return
        if out.finished:
            self._done(stream)
        stream.last_sent = time.monotonic()
        responses = stream.responses_for(out)
        for k, tensors in enumerate(responses):
            stream.send(tensors, out.finished and k == len(responses) - 1)

    def _fail(self, stream: Stream, message: str, code: Code) -> None:
        self._cancel_polls.forget(stream.request_id)
        self._done(stream)
        stream.fail(message, code)

    def _done(self, stream: Stream) -> None:
        if (task := self._task_of.pop(stream.request_id, None)) is not None:
            self.tasks.release(task)
        self._live.pop(stream.request_id, None)
        self._drained.discard(stream.request_id)
        with self._lock:
            self._in_flight -= 1

    def _probe_idle(self, now: float) -> None:
        """Probe every live request that has sent nothing for PROBE_INTERVAL."""
        for stream in list(self._live.values()):
            if now - stream.last_sent < PROBE_INTERVAL:
                continue
            stream.last_sent = now
            try:
                if stream.polled and stream.is_cancelled():  # a direct client left
                    self.cancelled(stream.request_id)
                else:
                    stream.send(stream.probe(), False)
            except Exception:  # this request's trouble: the others are still probed
                logger.exception("probing request %s failed", stream.request_id)

    def _check_health(self, now: float) -> None:
        if self._on_dead is not None and not self.service.healthy:
            on_dead, self._on_dead = self._on_dead, None
            on_dead(self.service.dead_reason or "the engine failed")
        if self._drain_deadline is None:
            if self._stopping is not None and self._stopping():
                logger.warning("the server is stopping: draining %d requests", len(self._live))
                self._drain_deadline = now + self.drain_timeout
        elif now >= self._drain_deadline and self._live.keys() - self._drained:
            # NOTE: they end the way a cancel does (finish_reason "abort"): an error after
            # streamed responses leaves a Triton 2.51 ensemble request in flight for good
            logger.warning("drain: aborting %d requests", len(self._live.keys() - self._drained))
            for request_id in self._live.keys() - self._drained:
                self._drained.add(request_id)
                self.service.abort(request_id)

    def _send_loop(self) -> None:
        next_probe = time.monotonic() + PROBE_INTERVAL
        while True:
            try:
                job = self._outbox.get(timeout=max(0.0, next_probe - time.monotonic()))
            except queue.Empty:
                job = _idle
            if job is None:
                return
            try:
                job()
            except Exception:
                logger.exception("sending a response failed")
            if (now := time.monotonic()) >= next_probe:
                next_probe = now + PROBE_INTERVAL / 4
                try:
                    self._probe_idle(now)
                    self._check_health(now)
                except Exception:  # never the end of this thread
                    logger.exception("probing failed")

    def cancelled(self, request_id: str) -> None:
        """A client cancelled (a direct one, or the ensemble's: reported by the detokenizer);
        logged as vllm_backend does."""
        logger.info("request %s: cancelled by its client, aborting it", request_id[:8])
        self.service.abort(request_id)

    abort = cancelled

    def lora_admin(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """A `lora_admin` request's one response (`serving.lora_admin`): list, load or unload
        adapters; called on the thread that reads the requests' adapter names."""
        check = lora_admin.adapter_check(self.engine.runner.lora)
        return lora_admin.respond(self.loras, value, check)

    def drain(self) -> None:
        """Refuse new requests; give those in flight `drain_timeout` seconds to finish, then
        abort them (the sender thread does, `_check_health`); return once none is left."""
        if self._drain_deadline is None:
            logger.warning("unloading: draining %d requests", self._in_flight)
            self._drain_deadline = time.monotonic() + self.drain_timeout
        give_up = self._drain_deadline + 10
        while self._in_flight and time.monotonic() < give_up:
            time.sleep(0.02)

    def shutdown(self) -> None:
        self.service.shutdown(drain=False, timeout=30)
        self._outbox.put(None)
        self._sender.join(timeout=30)
        self.engine.close()


def _idle() -> None:
    pass
