"""The agent gateway as a stranger on the network attacks it (issue 47, items 1-2): the online
gateway's file cannot be pointed anywhere, a body is never read before the key is checked nor
past its cap, stalled connections are capped and closed, and a huge prompt is refused before it
is tokenized (and tokenizing never runs on the event loop)."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from tests.training_core.gateway_harness import GatewayThread
from training_core.api import SamplingParams
from training_core.config import SpecError, load_spec
from training_core.gateway.http import Limits
from training_core.models.tiny import build_char_tokenizer
from training_core.workflows.online import write_gateway_file


class NoEngine:
    """Nothing here may reach generation: a call is recorded and fails."""

    version = 0

    def __init__(self):
        self.calls = []

    async def agenerate(self, request):
        self.calls.append(request)
        raise AssertionError("the engine was reached")


@pytest.fixture
def gw():
    thread = GatewayThread(None, build_char_tokenizer(), SamplingParams(max_new_tokens=8),
                           engine=NoEngine(), max_context=512,
                           limits=Limits(max_body=64 * 1024, head_timeout_s=1.0,
                                         body_timeout_s=2.0, idle_timeout_s=1.0,
                                         keepalive_s=1.0, max_per_peer=8, max_connections=16))
    yield thread
    thread.close()


def _connect(gw) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _status(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]) if data else 0


def _closed(s: socket.socket) -> bool:
    """The server closed the connection (reads what is left, then the end of the stream)."""
    try:
        while s.recv(65536):
            pass
    except (ConnectionResetError, TimeoutError):
        return False
    return True


HEAD = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n")


def test_a_400_mb_chunked_body_without_the_key_is_answered_before_a_byte_is_read(gw):
    s = _connect(gw)
    s.sendall((HEAD + "\r\n").encode() + b"17D78400\r\n" + b"x" * 4096)
    assert _status(s) == 401
    assert _closed(s)


def test_a_400_mb_chunk_with_the_key_is_refused_from_its_size_line(gw):
    s = _connect(gw)
    s.sendall((HEAD + f"Authorization: Bearer {gw.gateway.run_key}\r\n"
               "X-Oolong-Session: none\r\n\r\n").encode())
    assert _status(s) == 404  # the session is checked from the head too
    session = gw.open()
    s = _connect(gw)
    s.sendall((HEAD.replace("/v1/", f"/sessions/{session.id}/v1/")
               + f"Authorization: Bearer {session.key}\r\n\r\n").encode() + b"17D78400\r\n")
    assert _status(s) == 413  # from the size line: nothing of the chunk was read
    assert _closed(s)
    s = _connect(gw)  # many small chunks: refused at the cap (64 KB here), never buffered past it
    s.sendall((HEAD.replace("/v1/", f"/sessions/{session.id}/v1/")
               + f"Authorization: Bearer {session.key}\r\n\r\n").encode())
    sent = 0
    try:
        while sent < 10 * 2**20:
            s.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
            sent += 1024
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < 10 * 2**20  # the server hung up long before 10 MB
    assert not gw.engine.calls


def test_thirty_stalled_connections_are_capped_and_closed(gw):
    stalled = [_connect(gw) for _ in range(30)]
    for s in stalled:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # and never the rest
    answers = [None] * 30

    def read(i: int) -> None:
        answers[i] = _status(stalled[i])

    readers = [threading.Thread(target=read, args=(i,)) for i in range(30)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(15)
    # 8 per peer (this test's cap): the others are refused at once; the 8 are closed at the
    # head deadline (408), so they hold nothing for long.
    assert sorted(answers).count(503) == 22 and sorted(answers).count(408) == 8, answers
    # And the gateway still serves.
    s = _connect(gw)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
              + gw.gateway.run_key.encode() + b"\r\nX-Oolong-Session: nope\r\n\r\n")
    assert _status(s) == 404


def test_a_4_mb_message_is_refused_before_it_is_tokenized(monkeypatch):
    import httpx

    gw = GatewayThread(None, build_char_tokenizer(), SamplingParams(max_new_tokens=8),
                       engine=NoEngine(), max_context=512)  # the production HTTP limits
    try:
        _huge_message(gw, monkeypatch, httpx)
    finally:
        gw.close()


def _huge_message(gw, monkeypatch, httpx) -> None:
    renderer = gw.gateway.renderer
    threads = []
    real_full = renderer.full

    def full(messages, tools):
        threads.append(threading.current_thread().name)
        return real_full(messages, tools)

    monkeypatch.setattr(renderer, "full", full)
    session = gw.open()
    url = f"{gw.url}/sessions/{session.id}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {session.key}"}
    big = httpx.post(url, headers=headers, timeout=60,
                     json={"messages": [{"role": "user", "content": "9" * (4 * 2**20)}]})
    assert big.status_code == 400
    assert big.json()["error"]["param"] == "messages"
    assert big.json()["error"]["code"] == "context_length_exceeded"
    assert threads == [] and not gw.engine.calls  # never tokenized, never generated
    # A prompt that fits the text bound but not the context: tokenized (off the event loop),
    # then refused; the episode goes on.
    near = httpx.post(url, headers=headers, timeout=60,
                      json={"messages": [{"role": "user", "content": "9" * 4000}]})
    assert near.status_code == 400 and near.json()["error"]["code"] == "context_length_exceeded"
    assert threads == ["gateway-tokenize_0"]
    assert session.failure is None and session.turns == 0 and not gw.engine.calls


def test_the_gateway_file_is_no_spec_field_and_is_never_written_through_a_link(tmp_path):
    with pytest.raises(SpecError) as err:
        load_spec(None, [f"rollout.agent.gateway_file={tmp_path / 'victim'}"])
    assert "rollout.agent.gateway_file" in str(err.value)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "gateway.json").symlink_to(victim)
    write_gateway_file(run_dir / "gateway.json", "http://h:1", "rk-secret")
    assert victim.read_text() == "precious"
    path = run_dir / "gateway.json"
    assert not path.is_symlink() and json.loads(path.read_text())["url"] == "http://h:1"
    assert os.stat(path).st_mode & 0o777 == 0o600
