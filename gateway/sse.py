"""A server-sent-event stream: events encoded by sse-starlette's ServerSentEvent, sent by Starlette's
StreamingResponse from the request's own task, with one watcher task beside it.

Why not sse-starlette's EventSourceResponse: it runs each stream as an anyio task group of four tasks (body, ping
timer, disconnect listener, shutdown watcher) and opens a cancel scope for every send. That setup lies on the path to
a stream's first token, and on a 2-core host it also takes CPU from the prefill it overlaps. Here one watcher does
the two jobs that need a task: it sends a comment line every `ping_s` (proxies close silent connections) and, when
the client goes away, cancels the stream's task, whose body iterator then closes its worker calls (the worker drops
the request at its next step, whether it is prefilling, queued or decoding).

Server shutdown: uvicorn stops taking requests and lets streams in flight finish within its graceful-shutdown
timeout, then cancels them (sse-starlette would cut them at once).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Mapping

from sse_starlette.event import ServerSentEvent
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStream(StreamingResponse):
    """`events` yields each event's data (a str, one `data:` field per line); `ping_s` > 0 is the comment interval."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], ping_s: float, headers: Mapping[str, str] | None = None):
        super().__init__(self._encoded(events), headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no",
                                                         **(headers or {})})
        self.ping_s = ping_s
        self.ended = False  # the last body message is on its way: no ping may follow it
        self.gone = False  # the client disconnected

    @staticmethod
    async def _encoded(events: AsyncIterator[str]) -> AsyncIterator[bytes]:
        try:
            async for data in events:
                yield ServerSentEvent(data=data, sep="\n").encode()
        finally:
            await events.aclose()  # at once, in this task: it closes the worker calls

    async def _watch(self, receive: Receive, send: Send, stream: asyncio.Task) -> None:
        ping = ServerSentEvent(comment="ping", sep="\n").encode()
        while True:
            try:
                async with asyncio.timeout(self.ping_s if self.ping_s > 0 else None):
                    message = await receive()
            except TimeoutError:
                if self.ended:
                    return
                try:
                    await send({"type": "http.response.body", "body": ping, "more_body": True})
                except (OSError, RuntimeError):  # the client went away, or the response ended while this waited
                    return
                continue
            if message["type"] == "http.disconnect":
                self.gone = True
                stream.cancel()
                return

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self.ended = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, send, task))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not self.gone:
                raise  # cancelled from outside (server shutdown): not ours to absorb
            task.uncancel()
        except OSError:  # the client went away between two sends (uvicorn's ClientDisconnected): nothing to send
            return
        finally:
            self.ended = True
            watcher.cancel()
            await self.body_iterator.aclose()  # a send that failed left it open at a yield
