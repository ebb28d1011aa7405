"""Reading request bodies before a route sees them (ASGI middleware): every POST body read as JSON whatever its
Content-Type (`JSONBodies`), and limited in size and in time (`BodyLimit`: 413 above `max_body_bytes`, at once when
the Content-Length says so; 408 when one does not arrive within `body_seconds`; 503 at shutdown)."""

from __future__ import annotations

import asyncio

from .errors import APIError, _error_response
from .worker import (
    SHUTTING_DOWN,
    ShuttingDown,
)

# The largest request body served: far above any context length in tokens (a 128k-token prompt is about 1 MB of
# text or of token ids), far below what would hold up the server to parse.
DEFAULT_MAX_BODY_BYTES = 4 << 20
# A body must have arrived this long after its request began (a client sending a byte now and then holds a
# connection and its buffer: 408). 4 MiB on a slow link of 1 Mbit/s takes about 34 s.
DEFAULT_BODY_SECONDS = 60.0
# After a 413 has been sent, what the client still sends is read and dropped, up to this much and while it keeps
# coming, before the connection is closed: a client that writes its whole body before reading gets to read the
# answer instead of a reset connection.
DRAIN_BYTES = 64 << 20
DRAIN_IDLE_SECONDS = 1.0


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


class JSONBodies:
    """ASGI middleware: a POST body is read as JSON whatever its Content-Type says, so `requests.post(data=...)`,
    `curl -d` (form-encoded) or a client that sends no header at all is answered, not refused.

    Except from a browser page (a request with an `Origin` header): there a non-JSON content type is how another
    site's page posts to this server without a CORS preflight, so it keeps FastAPI's strict reading."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope["headers"])  # ASGI header names are lower case
            if b"origin" not in headers and not _is_json(headers.get(b"content-type", b"").decode("latin-1")):
                others = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
                scope = {**scope, "headers": [*others, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body above `max_bytes` is answered 413 (`request_too_large`) without being kept
    or parsed: at once when its Content-Length says so, else as soon as that many bytes have come; a body that has
    not arrived `seconds` after the request began is answered 408 (`request_timeout`), and one still arriving when
    `stopping` is set 503 (`shutting_down`). A body within the limits is passed on whole."""

    def __init__(self, app, max_bytes: int, seconds: float, stopping: asyncio.Event):
        self.app = app
        self.max_bytes = max_bytes
        self.seconds = seconds
        self.stopping = stopping

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.seconds
        body, received, more = [], 0, True
        while more:
            try:
                message = await _receive_before(receive, deadline, self.stopping)
            except TimeoutError:
                error = APIError(
                    408, f"the request body did not arrive within {self.seconds:g} s: send it at once, or start the "
                    "server with a longer --body-seconds", code="request_timeout",
                )
                await _error_response(error, {"Connection": "close"})(scope, receive, send)
                return
            except ShuttingDown:
                error = APIError(503, f"{SHUTTING_DOWN}: retry with another server or once it is back",
                                 type="server_error", code="shutting_down")
                await _error_response(error, {"Connection": "close"})(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return
            chunk, more = message.get("body", b""), message.get("more_body", False)
            received += len(chunk)
            if received > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            body.append(chunk)
        await self.app(scope, _replay(b"".join(body), receive), send)

    async def _too_large(self, scope, receive, send) -> None:
        """The 413 goes out whole at once; the response ends (and the connection closes) once what the client still
        sends has been read, up to `DRAIN_BYTES`, or nothing came for `DRAIN_IDLE_SECONDS`."""
        error = APIError(
            413, f"the request body is larger than {self.max_bytes} bytes, this server's limit: send a shorter "
            "prompt, or start the server with a larger --max-body-bytes", code="request_too_large",
        )
        body = error.body.model_dump_json().encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        drained, more, loop = 0, True, asyncio.get_running_loop()
        while more and drained <= DRAIN_BYTES and not self.stopping.is_set():
            try:
                message = await _receive_before(receive, loop.time() + DRAIN_IDLE_SECONDS, self.stopping)
            except (TimeoutError, ShuttingDown):
                break
            drained += len(message.get("body", b""))
            more = message["type"] != "http.disconnect" and message.get("more_body", False)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _receive_before(receive, deadline: float, stopping: asyncio.Event):
    """`receive()`, raising TimeoutError once the event loop's clock passes `deadline` and ShuttingDown as soon as
    `stopping` is set (a server shutting down waits for no body)."""
    if stopping.is_set():
        raise ShuttingDown
    receiving, stopped = asyncio.ensure_future(receive()), asyncio.ensure_future(stopping.wait())
    try:
        timeout = max(deadline - asyncio.get_running_loop().time(), 0)
        done, _ = await asyncio.wait((receiving, stopped), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not receiving.done():
            receiving.cancel()
    if receiving in done:
        return receiving.result()
    if stopped in done:
        raise ShuttingDown
    raise TimeoutError


def _replay(body: bytes, receive):
    """An ASGI receive that hands over `body` whole, then what `receive` brings (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again():
        return pending.pop() if pending else await receive()

    return receive_again
