"""A scripted rollout server for the rollout client's tests, reached through the client's own
HTTP/1.1 code.

``RolloutClient(urls, connect=ScriptedServer(handler))``: each connection the client opens is one
end of a socket pair, served in the client's own event loop by ``handler(request) -> response``
(httpx's Request and Response types, sync or async). So the production wire code runs (request
framing, response parsing, keep-alive, errors), only the far side is scripted, and a handler may
await events of the test's loop (a request held in flight until the trainer pauses, say).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import httpx

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


class ScriptedServer:
    def __init__(self, handler: Handler):
        self.handler = handler
        self.connections = 0
        self._tasks: set[asyncio.Task] = set()

    async def __call__(self, host: str, port: int):
        client_end, server_end = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=client_end)
        s_reader, s_writer = await asyncio.open_connection(sock=server_end)
        self.connections += 1
        task = asyncio.get_running_loop().create_task(self._serve(host, port, s_reader, s_writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return reader, writer

    async def _serve(self, host: str, port: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = h.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                request = httpx.Request(method, f"http://{host}:{port}{target}", content=body,
                                        headers=headers)
                response = self.handler(request)
                if inspect.isawaitable(response):
                    response = await response
                data = response.content
                reason = HTTPStatus(response.status_code).phrase
                writer.write(f"HTTP/1.1 {response.status_code} {reason}\r\n"
                             f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                             .encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()
