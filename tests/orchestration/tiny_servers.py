"""Many lightweight rollout servers in one process, for the supervise loop at scale: each listens
on its own loopback address and port and answers the routes the supervise loop calls as SGLang
0.5.23 does (``GET /model_info`` with ``weight_version``, ``GET /health``), after ``--delay``
seconds; the ``--hang`` ones accept and never answer (a node that froze). A control port
answers ``GET /stats``: the most requests that were in flight at once.

    python -m tests.orchestration.tiny_servers --count 32 --delay 0.2 --hang 3,17
prints one JSON line ``{"urls": [...], "control": "http://..."}`` once every server listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

state = {"in_flight": 0, "max_in_flight": 0, "requests": 0}


def _reply(body: dict, status: str = "200 OK") -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
            "\r\nConnection: keep-alive\r\n\r\n").encode() + data


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delay: float,
                 hang: bool, version: str) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            state["requests"] += 1
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                if hang:  # until the client gives up and closes the connection
                    while await reader.read(1024):
                        pass
                    return
                await asyncio.sleep(delay)
            finally:
                state["in_flight"] -= 1
            if path == "/model_info":
                out = _reply({"model_path": "/models/tiny", "weight_version": version,
                              "is_generation": True})
            elif path == "/health":
                out = _reply({})
            else:
                out = _reply({"detail": "Not Found"}, "404 Not Found")
            writer.write(out)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def _control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_reply(dict(state)))
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--hang", default="", help="comma-separated indices that never answer")
    parser.add_argument("--version", default="0")
    args = parser.parse_args(argv)
    hung = {int(i) for i in args.hang.split(",") if i}
    urls = []
    servers = []
    for i in range(args.count):
        host = f"127.0.0.{2 + i % 8}"  # spread over loopback "nodes"

        async def handler(r, w, _hang=i in hung):
            await _serve(r, w, delay=args.delay, hang=_hang, version=args.version)

        server = await asyncio.start_server(handler, host, 0)
        servers.append(server)
        urls.append(f"http://{host}:{server.sockets[0].getsockname()[1]}")
    control = await asyncio.start_server(_control, "127.0.0.1", 0)
    print(json.dumps({"urls": urls,
                      "control": f"http://127.0.0.1:{control.sockets[0].getsockname()[1]}"}),
          flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1:]))
    except KeyboardInterrupt:
        pass
