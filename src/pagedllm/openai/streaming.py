"""Streams of several samples: their Triton generations merged as they come, the
server-sent events of a streamed answer, and the client's disconnect cancelling the work."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.openai.errors import from_triton
from pagedllm.openai.responses import Builder
from pagedllm.openai.samples import Sample
from pagedllm.openai.triton import Chunk, TritonBridge, TritonError

T = TypeVar("T")


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def merged(
    bridge: TritonBridge, samples: list[Sample]
) -> AsyncGenerator[tuple[int, Chunk], None]:
    """(sample index, chunk) of every sample's generation, as they arrive. The first error is
    raised; closing the iterator (or an error) cancels the generations still running."""
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

    async def run(sample: Sample) -> None:
        try:
            async for chunk in bridge.generate(sample.generation):
                queue.put_nowait((sample.index, chunk))
        except Exception as e:
            queue.put_nowait((sample.index, e))
        finally:
            queue.put_nowait((sample.index, None))

    tasks = [asyncio.ensure_future(run(s)) for s in samples]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # each cancels its gRPC call (TritonBridge.generate)


async def collect(stream: AsyncIterator[tuple[int, Chunk]], samples: list[Sample]) -> None:
    async for index, chunk in stream:
        samples[index].add(chunk)


async def first_chunks(
    stream: AsyncIterator[tuple[int, Chunk]], count: int
) -> list[tuple[int, Chunk]]:
    """The chunks up to the first of every sample (all requests accepted by Triton)."""
    first: list[tuple[int, Chunk]] = []
    seen: set[int] = set()
    while len(seen) < count:
        index, chunk = await stream.__anext__()
        first.append((index, chunk))
        seen.add(index)
    return first


async def sse_body(
    builder: Builder,
    samples: list[Sample],
    first: list[tuple[int, Chunk]],
    stream: AsyncGenerator[tuple[int, Chunk], None],
    prompt_param: str,
) -> AsyncGenerator[str, None]:
    async def rest() -> AsyncIterator[tuple[int, Chunk]]:
        for item in first:
            yield item
        async for item in stream:
            yield item

    for index, chunk in first:  # the chunks sent first may show the prompt's usage
        samples[index].num_input_tokens = chunk.num_input_tokens
    try:
        for data in builder.start():
            yield sse(data)
        async for index, chunk in rest():
            sample = samples[index]
            sample.add(chunk)
            event = builder.chunk(sample, chunk)
            if event is not None:
                yield sse(event)
        if builder.body.include_usage:
            yield sse(builder.usage_chunk())
    except TritonError as e:
        yield sse(from_triton(e, prompt_param).body())
    finally:
        # a client that went away closes this generator here: the Triton requests go too
        await stream.aclose()
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, also when
    the client disconnected while an event was being sent (Starlette then leaves it open)."""

    body_iterator: AsyncGenerator[str, None]

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or cancel it when the client disconnects first (the request body has
    been read, so the next ASGI message is the disconnect)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        task.cancel()
        # let the work unwind (its finally blocks cancel Triton requests) before going on
        await asyncio.wait({task, watcher})


class ClientGone(Exception):
    pass
