"""`llm_engine` with the pooling runner (`runner: pooling`, docs/embeddings.md), without
Triton: requests are parsed (`embedding_codec`), queued to one thread, and run together — all
those queued when it is free, packed into forward passes by the `PoolingEngine`."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np

from pagedllm.config import EngineConfig
from pagedllm.pooling.engine import EmbedRequest, PoolingEngine
from pagedllm.pooling.params import PoolerConfig
from pagedllm.serving.codec import RequestError
from pagedllm.serving.embedding_codec import (
    NOT_POOLING,
    embedding_response,
    parse_embedding_request,
)
from pagedllm.serving.engine_stream import Fail, Send
from pagedllm.serving.inputs import Getter

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    request: EmbedRequest
    send: Send
    fail: Fail


class EmbeddingModel:
    """`llm_engine` with the pooling runner: `handle` parses and queues; one thread runs."""

    def __init__(self, config: EngineConfig, pooler_config: PoolerConfig | None = None) -> None:
        self.engine = PoolingEngine(config, pooler_config)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="pagedllm-pooling", daemon=True)
        self._thread.start()

    def handle(self, get: Getter, send: Send, fail: Fail) -> None:
        raw = get("embedding_request")
        if raw is None:
            fail(NOT_POOLING, "INVALID_ARG")
            return
        try:
            prompt, params = parse_embedding_request(np.asarray(raw).reshape(-1)[0])
            request = self.engine.prepare(prompt, params)
        except (RequestError, ValueError) as e:
            fail(str(e), "INVALID_ARG")
            return
        self._queue.put(_Job(request, send, fail))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            jobs = [job]
            while len(jobs) < 4 * self.engine.max_num_seqs:  # the engine packs them in passes
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
            self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        try:
            vectors = self.engine.embed([j.request for j in jobs])
        except Exception as e:  # a server fault: these requests fail, the model stays up
            logger.exception("embedding step failed")
            for j in jobs:
                j.fail(f"internal error: {type(e).__name__}: {e}", "INTERNAL")
            return
        for j, v in zip(jobs, vectors, strict=True):
            j.send(embedding_response(v.numpy(), len(j.request.token_ids)), True)
