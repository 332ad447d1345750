"""The one HTTP layer: what is retried, what is not, auth headers, the health poll."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from training_core.transport.http import ServerError, WebClient, wait_healthy


def scripted(statuses):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        status = statuses[min(len(calls), len(statuses)) - 1]
        return httpx.Response(status, json={"n": len(calls)})

    return handler, calls


def test_5xx_and_connection_errors_are_retried_then_succeed():
    handler, calls = scripted([503, 502, 200])
    web = WebClient.for_run("http://127.0.0.3:8000", "tok", transport=httpx.MockTransport(handler))
    assert web.get_json("/api/ingest/run/") == {"n": 3}
    assert calls[0].headers["Authorization"] == "Bearer tok"


def test_4xx_is_not_retried():
    handler, calls = scripted([403, 200])
    web = WebClient.for_user("http://127.0.0.3:8000", "abc", transport=httpx.MockTransport(handler))
    with pytest.raises(httpx.HTTPStatusError, match="403") as err:
        web.get_json("/api/runs/")
    assert not isinstance(err.value, ServerError)
    assert len(calls) == 1 and calls[0].headers["Authorization"] == "Token abc"


def test_the_retry_window_ends_with_the_last_error():
    handler, calls = scripted([500])
    web = WebClient.for_run("http://127.0.0.3:8000", "t", retry_window_s=0.5,
                            transport=httpx.MockTransport(handler))
    with pytest.raises(ServerError, match="500"):
        web.post_json("/api/ingest/status/", {"status": "running"})
    assert len(calls) >= 2
    calls.clear()
    with pytest.raises(ServerError):
        web.request("POST", "/x", retry=False)
    assert len(calls) == 1


def test_wait_healthy_reports_a_dead_process_instead_of_timing_out():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_healthy("http://127.0.0.4:9/health", 30,
                     dead=lambda: f"server exited with {proc.returncode}")
    with pytest.raises(TimeoutError, match="not healthy after 0s"):
        wait_healthy("http://127.0.0.4:9/health", 0.3)
