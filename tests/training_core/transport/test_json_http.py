"""The lean HTTP/1.1 JSON client of the rollout hot path, against real sockets: framing, reuse,
a server that drops idle connections, and failures raised as httpx's exception types."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from training_core.transport.json_http import JsonHttpClient


async def _serve(answer, host: str = "127.0.0.1"):
    """A real server on a free port; ``answer(request_body, n) -> bytes | None`` writes the raw
    response of the n-th request on a connection (None: close without answering)."""
    connections = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        connections.append(writer)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int([line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")][0])
                body = await reader.readexactly(length)
                n += 1
                raw = await answer(json.loads(body), n)
                if raw is None:
                    break
                writer.write(raw)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, host, 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://{host}:{port}", connections


def _json(payload, *, close: bool = False, status: int = 200) -> bytes:
    body = json.dumps(payload).encode()
    extra = b"Connection: close\r\n" if close else b""
    return (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def test_posts_json_and_reuses_one_connection():
    async def main():
        async def echo(body, n):
            return _json({"got": body, "n": n})

        server, url, conns = await _serve(echo)
        client = JsonHttpClient(timeout_s=5)
        answers = [await client.post(url + "/generate", {"i": i}) for i in range(3)]
        await client.aclose()
        server.close()
        return answers, len(conns)

    answers, connections = asyncio.run(main())
    assert [json.loads(b) for _, b in answers] == [{"got": {"i": i}, "n": i + 1} for i in range(3)]
    assert {s for s, _ in answers} == {200}
    assert connections == 1, "keep-alive: every request on the same connection"


def test_chunked_bodies_error_statuses_and_connection_close():
    async def main():
        async def answer(body, n):
            if body["kind"] == "chunked":
                return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"4\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n")
            if body["kind"] == "error":
                return _json({"detail": "bad field"}, status=422)
            return _json({"closing": True}, close=True)

        server, url, conns = await _serve(answer)
        client = JsonHttpClient(timeout_s=5)
        chunked = await client.post(url, {"kind": "chunked"})
        error = await client.post(url, {"kind": "error"})
        closing = await client.post(url, {"kind": "close"})
        after = await client.post(url, {"kind": "chunked"})  # needs a new connection
        await client.aclose()
        server.close()
        return chunked, error, closing, after, len(conns)

    chunked, error, closing, after, connections = asyncio.run(main())
    assert chunked == (200, b'{"a": 1}') and after == chunked
    assert error[0] == 422 and json.loads(error[1]) == {"detail": "bad field"}
    assert closing[0] == 200 and json.loads(closing[1]) == {"closing": True}
    assert connections == 2, "'Connection: close' is honoured, the next request reconnects"


def test_a_connection_the_server_dropped_while_idle_is_replaced_once():
    async def main():
        async def answer(body, n):
            return _json({"n": n})

        server, url, conns = await _serve(answer)
        client = JsonHttpClient(timeout_s=5)
        first = await client.post(url, {})
        conns[0].close()  # the server's keep-alive timeout
        await asyncio.sleep(0.05)
        second = await client.post(url, {})
        await client.aclose()
        server.close()
        return first, second, len(conns)

    first, second, connections = asyncio.run(main())
    assert json.loads(first[1]) == {"n": 1}
    assert json.loads(second[1]) == {"n": 1}, "answered on a fresh connection"
    assert connections == 2


def test_failures_are_httpx_errors_the_retry_policy_knows():
    async def main():
        async def silent(body, n):
            await asyncio.sleep(10)

        async def hang_up(body, n):
            return None

        slow, slow_url, _ = await _serve(silent)
        rude, rude_url, _ = await _serve(hang_up)
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            closed_url = f"http://127.0.0.1:{s.getsockname()[1]}"
        client = JsonHttpClient(timeout_s=0.3)
        errors = []
        for url in (slow_url, rude_url, closed_url):
            try:
                await client.post(url, {})
            except httpx.TransportError as exc:
                errors.append(type(exc))
        await client.aclose()
        slow.close()
        rude.close()
        return errors

    assert asyncio.run(main()) == [httpx.ReadTimeout, httpx.ReadError, httpx.ConnectError]


def test_a_closed_client_refuses_new_requests():
    client = JsonHttpClient(timeout_s=1)
    asyncio.run(client.aclose())
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(client.post("http://127.0.0.1:9/x", {}))
