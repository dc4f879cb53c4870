"""The HTTP side of the API that is not OpenAI's: request bodies read under a size limit, the server's
drain on shutdown (:class:`Drain`), and server-sent-event streams that cancel their engine requests when
the client goes away or stops reading (:class:`EngineStream`)."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect


class PayloadTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (PayloadTooLarge) from its Content-Length or once more than ``limit``
    bytes have come, without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body has {declared} bytes; this server takes at most {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
    return bytes(body)


class Drain:
    """The requests in flight, and the server's shutdown: :meth:`drain` refuses new requests and waits
    for the running ones (aborting those left at its deadline)."""

    def __init__(self):
        self.draining = False
        self._live: dict[int, Callable[[], None]] = {}  # request id -> abort its sequences
        self._ids = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self, abort: Callable[[], None]) -> int:
        key = next(self._ids)
        self._live[key] = abort
        self._idle.clear()
        return key

    def leave(self, key: int) -> None:
        self._live.pop(key, None)
        if not self._live:
            self._idle.set()

    @property
    def live(self) -> int:
        return len(self._live)

    async def drain(self, timeout_s: float, abort_grace_s: float = 10.0) -> bool:
        """Refuse new requests; wait up to ``timeout_s`` for the running ones, then abort those left
        (``finish_reason: abort``) and wait up to ``abort_grace_s`` for their last bytes. True when every
        request ended."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            for abort in list(self._live.values()):
                abort()
        try:
            await asyncio.wait_for(self._idle.wait(), abort_grace_s)
            return True
        except asyncio.TimeoutError:
            return False


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def cancel_on_disconnect(receive, cancel) -> None:
    """Wait for the client to go away, then ``cancel()`` (run as a task beside a response)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel()


class EngineStream(StreamingResponse):
    """An SSE response that cancels its requests when it ends for any reason: the client going away
    while the requests wait for their first token (seen by ``receive``) or mid-stream (a failed send),
    or a send that waits more than ``idle_timeout_s`` (a client that stopped reading: the response is
    abandoned, so the connection closes). ``done`` runs last."""

    def __init__(self, content, cancel, idle_timeout_s: float, done: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.cancel, self.idle_timeout_s, self.done = cancel, idle_timeout_s, done

    async def __call__(self, scope, receive, send):
        sending_since: list[float | None] = [None]
        loop = asyncio.get_running_loop()

        async def timed_send(message):
            sending_since[0] = loop.time()
            await send(message)
            sending_since[0] = None

        async def idle_watch(response: asyncio.Task):
            while not response.done():
                await asyncio.sleep(self.idle_timeout_s / 4)
                since = sending_since[0]
                if since is not None and loop.time() - since > self.idle_timeout_s:
                    self.cancel()
                    response.cancel()
                    return

        watcher = asyncio.create_task(cancel_on_disconnect(receive, self.cancel))
        response = asyncio.create_task(super().__call__(scope, receive, timed_send))
        idle = asyncio.create_task(idle_watch(response))
        try:
            await response
        except (OSError, ClientDisconnect):  # the client left; nothing to answer
            pass
        except asyncio.CancelledError:
            if not response.cancelled() or asyncio.current_task().cancelling():
                raise
        finally:
            watcher.cancel()
            idle.cancel()
            self.cancel()
            self.done()
