"""How a queued job's reply reaches its client: `JobResponse`, an ASGI response that sends the job's events as
server-sent events (`data: {chunk}` … `data: [DONE]`) or, not streaming, one JSON body once the reply ends, and that
listens for the client going away the whole time (queued or generating): a disconnect cancels the job at once.

Also `json_response` / `json_bytes`, the JSON every endpoint answers with. Imports errors.py, replies.py and
worker.py (for types); no web framework: these are plain ASGI callables Starlette routes return.
"""

from __future__ import annotations

import asyncio
import json

from localmoe.server.errors import ApiError, error_body
from localmoe.server.replies import ReplyBuilder
from localmoe.server.worker import Job

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class JsonResponse:
    """A JSON body with a status (and extra headers), as an ASGI callable."""

    def __init__(self, obj, status: int = 200, headers: dict[str, str] | None = None):
        self.body, self.status, self.headers = json_bytes(obj), status, headers or {}

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


def error_response(err: ApiError) -> JsonResponse:
    return JsonResponse(error_body(err.status, err.message, param=err.param, code=err.code), err.status, err.headers)


def _sse(obj) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


class JobResponse:
    """The reply to a submitted job. `after(builder, stats)` runs once the reply ended normally (the server's log
    line, prefilling the conversation's next turn)."""

    def __init__(self, job: Job, builder: ReplyBuilder, stream: bool, after=None):
        self.job, self.builder, self.stream, self.after = job, builder, stream, after

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(self._watch(receive))
        try:
            if self.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except OSError:  # the client went away while we wrote (uvicorn's ClientDisconnected is an OSError)
            pass
        finally:
            watcher.cancel()
            self.job.cancel()  # a no-op once the reply ended; otherwise the client is gone: stop generating

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.job.cancel()
                self.job.events.put_nowait(("gone", None))
                return

    async def _items(self):
        """The job's items, a batch at a time (everything already waiting is taken with the first)."""
        while True:
            batch = [await self.job.events.get()]
            while not self.job.events.empty():
                batch.append(self.job.events.get_nowait())
            yield batch

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        b = self.builder
        first = b.first_chunk()
        if first is not None:
            await send({"type": "http.response.body", "body": _sse(first), "more_body": True})
        async for batch in self._items():
            out, end = [], False
            for kind, payload in batch:
                if kind == "event":
                    out += [_sse(b.chunk(d)) for d in b.feed(payload)]
                elif kind == "done":
                    out += [_sse(b.chunk(d)) for d in b.end()]
                    out += [_sse(c) for c in b.last_chunks(payload, self.job.queue_s)] + [b"data: [DONE]\n\n"]
                    self._finished(payload)
                    end = True
                    break
                elif kind == "error":
                    out += [_sse(payload.body()), b"data: [DONE]\n\n"]
                    end = True
                    break
                else:  # gone
                    return
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": not end})
            if end:
                if not out:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return

    async def _whole(self, send) -> None:
        b = self.builder
        async for batch in self._items():
            for kind, payload in batch:
                if kind == "event":
                    b.feed(payload)
                elif kind == "done":
                    b.end()
                    self._finished(payload)
                    await JsonResponse(b.response(payload, self.job.queue_s))(None, None, send)
                    return
                elif kind == "error":
                    await error_response(payload)(None, None, send)
                    return
                else:
                    return

    def _finished(self, stats) -> None:
        if self.after is not None:
            self.after(self.builder, stats)
