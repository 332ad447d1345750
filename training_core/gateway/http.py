"""A small HTTP/1.1 server on asyncio streams, for TCP and Unix sockets alike.

Why not uvicorn: the gateway runs inside the rollout executor's event loop (where
``agenerate`` lives) and opens one Unix-socket listener per agent episode; a full ASGI server per
episode is heavy, and this is the subset OpenAI's clients use: JSON bodies with
``Content-Length``, keep-alive, and server-sent events sent with chunked transfer coding.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MAX_BODY = 8 * 2**20  # a request larger than this is refused (413)
MAX_HEADER_LINES = 100
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 409: "Conflict", 413: "Payload Too Large",
           429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

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
    it is already a string)."""

    events: AsyncIterator[Any]
    status: int = 200


Handler = Callable[[Request], Awaitable[Response | EventStream]]


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    line = await reader.readline()
    if not line:
        return None
    try:
        method, target, _ = line.decode("latin-1").split(" ", 2)
    except ValueError:
        raise _BadRequest("malformed request line") from None
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        raw = await reader.readline()
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    else:
        raise _BadRequest("too many header lines")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = b""
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                break
            body += await reader.readexactly(size)
            await reader.readline()
            if len(body) > MAX_BODY:
                raise _BadRequest("body too large", 413)
    else:
        length = int(headers.get("content-length", "0") or 0)
        if length > MAX_BODY:
            raise _BadRequest("body too large", 413)
        body = await reader.readexactly(length) if length else b""
    return Request(method.upper(), target.split("?", 1)[0], headers, body)


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _write(writer: asyncio.StreamWriter, result: Response | EventStream, keep: bool) -> None:
    conn = "keep-alive" if keep else "close"
    if isinstance(result, Response):
        body = b"" if result.body is None else json.dumps(result.body).encode()
        writer.write(_head(result.status, {"Content-Type": "application/json",
                                           "Content-Length": str(len(body)),
                                           "Connection": conn, **result.headers}) + body)
        await writer.drain()
        return
    writer.write(_head(result.status, {"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "Connection": conn,
                                       "Transfer-Encoding": "chunked"}))
    async for event in result.events:
        data = event if isinstance(event, str) else json.dumps(event)
        chunk = f"data: {data}\n\n".encode()
        writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


def connection_handler(handler: Handler, live: set[asyncio.Task] | None = None
                       ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A callback for ``asyncio.start_server``/``start_unix_server`` serving ``handler``; each
    connection's task is kept in ``live`` while it runs (to cancel them at shutdown)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if live is not None and task is not None:
            live.add(task)
        try:
            while True:
                try:
                    request = await _read_request(reader)
                except _BadRequest as exc:
                    await _write(writer, error_response(exc.status, str(exc)), keep=False)
                    return
                except (asyncio.IncompleteReadError, ValueError):
                    return
                if request is None:
                    return
                keep = request.headers.get("connection", "").lower() != "close"
                try:
                    result = await handler(request)
                except Exception:  # a bug must not take the connection loop down silently
                    log.exception("gateway handler failed")
                    result = error_response(500, "internal gateway error", kind="server_error")
                await _write(writer, result, keep)
                if not keep:
                    return
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if live is not None:
                live.discard(task)
            writer.close()

    return serve


def error_response(status: int, message: str, *, param: str | None = None,
                   kind: str = "invalid_request_error", code: str | None = None) -> Response:
    """OpenAI's error shape: the SDKs read ``error.message`` and ``error.param``."""
    return Response(status, {"error": {"message": message, "type": kind, "param": param,
                                       "code": code}})
