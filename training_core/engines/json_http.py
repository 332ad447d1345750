"""A lean HTTP/1.1 client for the rollout hot path: POST a JSON body, read a JSON answer, over
keep-alive connections on asyncio streams.

Why not httpx there: the trainer's executor thread sends every generation request, and its
Python time is time the trainer's own thread waits for the GIL between the small ops of a
forward pass. Profiled in an asynchronous run on 2 cores, the executor thread held the GIL about
half the time, two thirds of it inside httpx/httpcore (the connection pool checks every pooled
connection's socket through anyio at each request). This client does per request what HTTP/1.1
needs and nothing else. Failures raise httpx's exception types, so the callers' retry policy and
error handling are the same for both clients.

Bodies are read by ``Content-Length`` or chunked transfer coding (uvicorn and SGLang send the
former for JSON); ``Connection: close`` is honoured. A request on a reused connection that the
server closed while it idled is sent once more on a fresh connection.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any
from urllib.parse import urlsplit

import httpx

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class JsonHttpClient:
    """One per event loop (streams belong to the loop that opened them)."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = defaultdict(list)
        self.closed = False

    async def post(self, url: str, payload: Any) -> tuple[int, bytes]:
        """(status, body) of ``POST url`` with ``payload`` as JSON."""
        if self.closed:
            raise RuntimeError("the client is closed")
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nAccept: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        key = (host, port)
        while True:
            reused = bool(self._idle[key])
            conn = self._idle[key].pop() if reused else await self._connect(host, port, url)
            try:
                status, data, keep = await asyncio.wait_for(
                    _exchange(conn, head + body), self.timeout_s)
            except TimeoutError:
                conn[1].close()
                raise httpx.ReadTimeout(f"no answer from {url} within {self.timeout_s:.0f}s") from None
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                conn[1].close()
                if reused:  # the server closed it while it idled: once more on a fresh one
                    continue
                raise httpx.ReadError(f"{url}: {type(exc).__name__}: {exc}") from exc
            except BaseException:  # cancelled: the connection is mid-exchange, never reuse it
                conn[1].close()
                raise
            if keep:
                self._idle[key].append(conn)
            else:
                conn[1].close()
            return status, data

    async def _connect(self, host: str, port: int, url: str) -> _Conn:
        try:
            return await asyncio.wait_for(asyncio.open_connection(host, port),
                                          self.connect_timeout_s)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {url} took over "
                                       f"{self.connect_timeout_s:.0f}s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{url}: {exc}") from exc

    async def aclose(self) -> None:
        self.closed = True
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()


async def _exchange(conn: _Conn, request: bytes) -> tuple[int, bytes, bool]:
    reader, writer = conn
    writer.write(request)
    await writer.drain()
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("connection closed before an answer")
    version, status, *_ = status_line.decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            break
        if not line:
            raise ConnectionResetError("connection closed in the headers")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                break
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
        data = b"".join(chunks)
    elif "content-length" in headers:
        data = await reader.readexactly(int(headers["content-length"]))
    else:  # no framing: the body runs to the end of the connection
        data = await reader.read()
        headers["connection"] = "close"
    framed = "content-length" in headers or "transfer-encoding" in headers
    keep = (framed and version.upper() == "HTTP/1.1"
            and headers.get("connection", "").lower() != "close")
    return int(status), data, keep
