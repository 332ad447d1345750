"""A lean HTTP/1.1 client for the rollout hot path: POST a JSON body, read a JSON answer, over
keep-alive connections on asyncio streams.

Why not httpx there: the trainer's executor thread sends every generation request, and its
Python time is time the trainer's own thread waits for the GIL between the small ops of a
forward pass. Profiled in an asynchronous run on 2 cores, the executor thread held the GIL about
half the time, two thirds of it inside httpx/httpcore (the connection pool checks every pooled
connection's socket through anyio at each request). This client does per request what HTTP/1.1
needs and nothing else. Failures raise httpx's exception types, so the callers' retry policy and
error handling are the same for both clients.

It carries every call to a rollout server, GET and POST, generation and control: one transport,
so what the tests exercise is what production runs. Tests script the server side, not the client:
``connect`` replaces ``asyncio.open_connection`` (e.g. with one end of a socket pair whose other
end a scripted handler serves), and everything above the socket is the production code.

Bodies are read by ``Content-Length`` or chunked transfer coding (uvicorn and SGLang send the
former for JSON); ``Connection: close`` is honoured. A request on a reused connection that the
server closed while it idled is sent once more on a fresh connection.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Connector = Callable[[str, int], Awaitable[_Conn]]


class JsonHttpClient:
    """One per event loop (streams belong to the loop that opened them)."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float = 10.0,
                 connect: Connector | None = None, bearer: str | None = None):
        self.timeout_s = timeout_s
        # the run's rollout-server key, sent with every request (transport/server_auth.py)
        self._auth = f"Authorization: Bearer {bearer}\r\n" if bearer else ""
        self.connect_timeout_s = connect_timeout_s
        self._open: Connector = connect or asyncio.open_connection
        self._idle: dict[tuple[str, int], list[_Conn]] = defaultdict(list)
        self.closed = False

    async def post(self, url: str, payload: Any) -> tuple[int, bytes]:
        """(status, body) of ``POST url`` with ``payload`` as JSON."""
        return await self.request("POST", url, payload)

    async def get(self, url: str, *, timeout_s: float | None = None) -> tuple[int, bytes]:
        """(status, body) of ``GET url``."""
        return await self.request("GET", url, timeout_s=timeout_s)

    async def request(self, method: str, url: str, payload: Any = None, *,
                      timeout_s: float | None = None) -> tuple[int, bytes]:
        """(status, body) of ``method url``, with ``payload`` as the JSON body unless None."""
        if self.closed:
            raise RuntimeError("the client is closed")
        timeout_s = timeout_s or self.timeout_s
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        typed = "" if payload is None else "Content-Type: application/json\r\n"
        head = (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{typed}"
                f"Accept: application/json\r\n{self._auth}Content-Length: {len(body)}\r\n\r\n"
                ).encode()
        key = (host, port)
        while True:
            reused = bool(self._idle[key])
            conn = self._idle[key].pop() if reused else await self._connect(host, port, url)
            try:
                status, data, keep = await asyncio.wait_for(
                    _exchange(conn, head + body), timeout_s)
            except TimeoutError:
                conn[1].close()
                raise httpx.ReadTimeout(f"no answer from {url} within {timeout_s:.0f}s") from None
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
            return await asyncio.wait_for(self._open(host, port), self.connect_timeout_s)
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


def get_status(url: str, timeout_s: float = 2.0) -> int:
    """The status of one ``GET url``, from synchronous code (health polls): the same client, so a
    rollout server's health is read over the transport that carries its generation."""
    async def once() -> int:
        client = JsonHttpClient(timeout_s=timeout_s, connect_timeout_s=timeout_s)
        try:
            return (await client.get(url))[0]
        finally:
            await client.aclose()

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # plain synchronous code
        return asyncio.run(once())
    # Called from inside an event loop (a coroutine restarting a server): a loop of its own, on a
    # thread of its own; this one is blocked meanwhile, as with any synchronous call.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="get-status") as pool:
        return pool.submit(asyncio.run, once()).result()


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
