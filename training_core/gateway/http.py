"""A small HTTP/1.1 server on asyncio streams, for TCP and Unix sockets alike.

Why not uvicorn: the gateway runs inside the rollout executor's event loop (where
``agenerate`` lives) and opens one Unix-socket listener per agent episode; a full ASGI server per
episode is heavy, and this is the subset OpenAI's clients use: JSON bodies with
``Content-Length`` or chunked transfer coding, keep-alive, and server-sent events sent with
chunked transfer coding.

Everything a stranger sends is bounded before it is held (the online gateway listens on the
network, inside the trainer's rollout loop):

- a request is **authorized from its head** (the ``authorize`` callback) before a byte of its
  body is read: a wrong key is answered and the connection closed, the body never read;
- the body is capped (``max_body``) before it is read: a ``Content-Length`` or a chunk size that
  would pass the cap is a 413 at once, never buffered;
- **deadlines**: the request head must arrive within ``head_timeout_s``, the body within
  ``body_timeout_s``, no gap between bytes may pass ``idle_timeout_s``, an idle kept-alive
  connection is closed after ``keepalive_s``, and a client that stops reading a response is
  dropped after ``write_timeout_s``;
- **connection caps** per listener and per peer address: one more is answered 503 and closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MAX_HEADER_LINES = 100
LINE_LIMIT = 16 * 1024  # a request line, header line or chunk-size line longer than this: 400
REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
           413: "Payload Too Large", 429: "Too Many Requests", 500: "Internal Server Error",
           503: "Service Unavailable"}


@dataclass(frozen=True)
class Limits:
    """What one listener accepts (module doc)."""

    max_body: int = 8 * 2**20
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 10.0
    keepalive_s: float = 60.0
    write_timeout_s: float = 60.0
    max_connections: int = 256
    max_per_peer: int = 64


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""
    peer: str = ""
    # What ``authorize`` found from the head (the session, ...), for the handler.
    context: dict[str, Any] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body or b"null")


@dataclass
class Response:
    status: int = 200
    body: Any = None  # JSON-encoded
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class EventStream:
    """Server-sent events: each item of ``events`` is one ``data:`` payload (JSON-encoded unless
    it is already a string), or an ``(event name, payload)`` pair for APIs that name their events
    (Anthropic's, OpenAI's Responses)."""

    events: AsyncIterator[Any]
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    # Awaited once the stream is written or abandoned, whatever happened (a client gone before
    # the first event included): what the events hold (a turn's lock) is released.
    close: Callable[[], Awaitable[None]] | None = None


Handler = Callable[[Request], Awaitable[Response | EventStream]]
Authorize = Callable[[Request], Response | None]


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class _Reader:
    """Reads under the per-request and between-bytes deadlines."""

    def __init__(self, reader: asyncio.StreamReader, limits: Limits):
        self.reader, self.limits = reader, limits
        self.deadline = 0.0

    def _timeout(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _BadRequest("request not received in time", 408)
        return min(left, self.limits.idle_timeout_s)

    async def line(self) -> bytes:
        try:
            async with asyncio.timeout(self._timeout()):
                return await self.reader.readline()
        except TimeoutError:
            raise _BadRequest("request not received in time", 408) from None
        except ValueError:  # longer than the stream's limit
            raise _BadRequest("a request line or header is too long") from None

    async def exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                async with asyncio.timeout(self._timeout()):
                    data = await self.reader.read(min(n - len(out), 65536))
            except TimeoutError:
                raise _BadRequest("request body not received in time", 408) from None
            if not data:
                raise asyncio.IncompleteReadError(bytes(out), n)
            out += data
        return bytes(out)


async def _read_head(r: _Reader, limits: Limits, first: bool) -> Request | None:
    # The first request of a connection must start at once; a kept-alive one may idle.
    r.deadline = time.monotonic() + (limits.head_timeout_s if first else limits.keepalive_s)
    try:
        async with asyncio.timeout(r.deadline - time.monotonic()):
            line = await r.reader.readline()
    except TimeoutError:
        return None  # idle: close quietly
    except ValueError:
        raise _BadRequest("the request line is too long") from None
    if not line:
        return None
    r.deadline = time.monotonic() + limits.head_timeout_s
    try:
        method, target, _ = line.decode("latin-1").split(" ", 2)
    except ValueError:
        raise _BadRequest("malformed request line") from None
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        raw = await r.line()
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    else:
        raise _BadRequest("too many header lines")
    return Request(method.upper(), target.split("?", 1)[0], headers)


async def _read_body(r: _Reader, request: Request, limits: Limits) -> bytes:
    r.deadline = time.monotonic() + limits.body_timeout_s
    headers = request.headers
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            try:
                size = int((await r.line()).split(b";")[0].strip() or b"0", 16)
            except ValueError:
                raise _BadRequest("malformed chunk size") from None
            if size < 0 or len(body) + size > limits.max_body:  # refused before it is read
                raise _BadRequest(f"body larger than {limits.max_body} bytes", 413)
            if size == 0:
                while (await r.line()) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return bytes(body)
            body += await r.exactly(size)
            await r.line()
    try:
        length = int(headers.get("content-length", "0") or 0)
    except ValueError:
        raise _BadRequest("malformed Content-Length") from None
    if length < 0 or length > limits.max_body:
        raise _BadRequest(f"body larger than {limits.max_body} bytes", 413)
    return await r.exactly(length) if length else b""


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _drain(writer: asyncio.StreamWriter, limits: Limits) -> None:
    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that arrives
    # as the awaited call completes, and a closing gateway would wait a keep-alive out.
    async with asyncio.timeout(limits.write_timeout_s):
        await writer.drain()


async def _write(writer: asyncio.StreamWriter, result: Response | EventStream, keep: bool,
                 limits: Limits) -> None:
    conn = "keep-alive" if keep else "close"
    if isinstance(result, Response):
        body = b"" if result.body is None else json.dumps(result.body).encode()
        writer.write(_head(result.status, {"Content-Type": "application/json",
                                           "Content-Length": str(len(body)),
                                           "Connection": conn, **result.headers}) + body)
        await _drain(writer, limits)
        return
    events = result.events
    try:
        writer.write(_head(result.status, {"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", "Connection": conn,
                                           "Transfer-Encoding": "chunked", **result.headers}))
        await _drain(writer, limits)
        async for event in events:
            name = None
            if isinstance(event, tuple):
                name, event = event
            data = event if isinstance(event, str) else json.dumps(event)
            chunk = (f"event: {name}\n" if name else "") + f"data: {data}\n\n"
            raw = chunk.encode()
            writer.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            await _drain(writer, limits)
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:  # a client that went away: the generator's cleanup runs now
            await close()
        if result.close is not None:
            await result.close()
    writer.write(b"0\r\n\r\n")
    await _drain(writer, limits)


def connection_handler(handler: Handler, live: set[asyncio.Task] | None = None, *,
                       authorize: Authorize | None = None, limits: Limits = Limits()
                       ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A callback for ``asyncio.start_server``/``start_unix_server`` serving ``handler``; each
    connection's task is kept in ``live`` while it runs (to cancel them at shutdown).
    ``authorize(request)`` sees the request's head (no body yet): a response it returns is sent
    and the connection closed. Start the server with ``limit=LINE_LIMIT``."""
    peers: Counter[str] = Counter()
    open_count = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer_info = writer.get_extra_info("peername")
        peer = peer_info[0] if isinstance(peer_info, tuple) and peer_info else "local"
        if open_count[0] >= limits.max_connections or peers[peer] >= limits.max_per_peer:
            try:
                writer.write(_head(503, {"Content-Length": "0", "Connection": "close"}))
                async with asyncio.timeout(1.0):
                    await writer.drain()
            except (ConnectionError, TimeoutError):
                pass
            writer.close()
            return
        open_count[0] += 1
        peers[peer] += 1
        if live is not None and task is not None:
            live.add(task)
        r = _Reader(reader, limits)
        first = True
        try:
            while True:
                try:
                    request = await _read_head(r, limits, first)
                    first = False
                    if request is None:
                        return
                    request.peer = peer
                    denied = authorize(request) if authorize is not None else None
                    if denied is not None:  # the body is never read
                        await _write(writer, denied, False, limits)
                        return
                    request.body = await _read_body(r, request, limits)
                except _BadRequest as exc:
                    await _write(writer, error_response(exc.status, str(exc)), False, limits)
                    return
                except asyncio.IncompleteReadError:
                    return
                keep = request.headers.get("connection", "").lower() != "close"
                try:
                    result = await handler(request)
                except Exception:  # a bug must not take the connection loop down silently
                    log.exception("gateway handler failed")
                    result = error_response(500, "internal gateway error", kind="server_error")
                await _write(writer, result, keep, limits)
                if not keep:
                    return
        except (ConnectionError, TimeoutError, asyncio.CancelledError):
            pass
        finally:
            open_count[0] -= 1
            peers[peer] -= 1
            if peers[peer] <= 0:
                del peers[peer]
            if live is not None:
                live.discard(task)
            writer.close()

    return serve


def error_response(status: int, message: str, *, param: str | None = None,
                   kind: str = "invalid_request_error", code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error shape: the SDKs read ``error.message``, ``error.param`` and ``error.code``."""
    return Response(status, {"error": {"message": message, "type": kind, "param": param,
                                       "code": code}}, dict(headers or {}))
