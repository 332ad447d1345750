"""Oolong's one HTTP layer: the retry policy, the health poll, and the client of the web app's API.

Retry policy (tenacity): connection errors and 5xx are retried with exponential backoff and
jitter until a time window has passed; a 4xx is the caller's error and is never retried.
Every client of ours uses it: the rollout client (generation and control calls), the flow's
tracker, the remote-run setup and the HTTP metrics sink.

Auth: the web app takes a run's ingest token as ``Bearer`` (GPU-side processes) and a user's API
token as ``Token`` (the CLI, the demo); :class:`WebClient` builds either header.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from training_core.transport.json_http import get_status


class ServerError(httpx.HTTPStatusError):
    """A 5xx answer: the server's trouble, worth retrying."""


RETRYABLE = (httpx.TransportError, ServerError)

# A server that has refused every connection for this long is dead, not restarting slowly: the
# caller gives up then, however long its retry window (issue 47: killing a run's only rollout
# server failed the run after 124 s of retries, saying only "servers unreachable").
DEAD_AFTER_S = 30.0


def refused(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it wraps) is a refused connection: nothing listens there."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ConnectionRefusedError) or "Connection refused" in str(exc) \
                or "Connect call failed" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class stop_when_refused_for:  # noqa: N801 - named like tenacity's own stop conditions
    """Stop once every attempt of the last ``seconds`` was a refused connection."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.since: float | None = None

    def __call__(self, retry_state: Any) -> bool:
        outcome = retry_state.outcome
        if outcome is None or not refused(outcome.exception()):
            self.since = None
            return False
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        return now - self.since >= self.seconds


def raise_for_status(resp: httpx.Response) -> httpx.Response:
    """5xx raises :class:`ServerError` (retried), 4xx ``httpx.HTTPStatusError`` (not retried)."""
    if resp.status_code < 400:
        return resp
    if not resp.is_stream_consumed:
        resp.read()  # a streamed error: its body is the message
    message = f"{resp.request.url} -> {resp.status_code}: {resp.text[:300]}"
    cls = ServerError if resp.status_code >= 500 else httpx.HTTPStatusError
    raise cls(message, request=resp.request, response=resp)


def _policy(window_s: float, min_attempts: int, max_delay_s: float,
            retry_on: tuple[type[BaseException], ...], dead_after_s: float | None) -> dict[str, Any]:
    # Give up only when both hold: enough attempts made and the window spent; or, with
    # ``dead_after_s``, once nothing has accepted a connection for that long.
    stop = stop_after_delay(window_s) & stop_after_attempt(max(min_attempts, 1))
    if dead_after_s is not None:
        stop = stop | stop_when_refused_for(dead_after_s)
    return {
        "retry": retry_if_exception_type(retry_on),
        "wait": wait_exponential_jitter(initial=0.2, max=max_delay_s, jitter=0.1),
        "stop": stop,
        "reraise": True,
    }


def retrying(window_s: float, *, min_attempts: int = 1, max_delay_s: float = 5.0,
             retry_on: tuple[type[BaseException], ...] = RETRYABLE,
             dead_after_s: float | None = None) -> Retrying:
    """``for attempt in retrying(60): with attempt: ...`` (the last error is re-raised)."""
    return Retrying(**_policy(window_s, min_attempts, max_delay_s, retry_on, dead_after_s))


def aretrying(window_s: float, *, min_attempts: int = 1, max_delay_s: float = 5.0,
              retry_on: tuple[type[BaseException], ...] = RETRYABLE,
              dead_after_s: float | None = None) -> AsyncRetrying:
    """The same policy for coroutines: ``async for attempt in aretrying(60): with attempt: ...``."""
    return AsyncRetrying(**_policy(window_s, min_attempts, max_delay_s, retry_on, dead_after_s))


def wait_healthy(url: str, timeout_s: float, *, dead: Callable[[], str | None] | None = None,
                 interval_s: float = 0.25, ok: Callable[[int], bool] = lambda s: s == 200) -> None:
    """Poll ``GET url`` until ``ok(status)``; ``dead()`` returns a reason once the process behind
    it has exited (then waiting longer is pointless)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if dead is not None and (reason := dead()) is not None:
            raise RuntimeError(reason)
        try:
            if ok(get_status(url, timeout_s=2.0)):
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")
        time.sleep(interval_s)


class WebClient:
    """A client of the Oolong web app's API. ``WebClient.for_run(url, token)`` authenticates as a
    run (its ingest token), ``WebClient.for_user(url, token)`` as a user (API token)."""

    def __init__(self, base_url: str, auth_header: str, *, timeout_s: float = 30.0,
                 retry_window_s: float = 60.0, transport: httpx.BaseTransport | None = None):
        self.base = base_url.rstrip("/")
        self.retry_window_s = retry_window_s
        self.http = httpx.Client(base_url=self.base, timeout=timeout_s, transport=transport,
                                 headers={"Authorization": auth_header})

    @classmethod
    def for_run(cls, base_url: str, token: str, **kw: Any) -> WebClient:
        return cls(base_url, f"Bearer {token}", **kw)

    @classmethod
    def for_user(cls, base_url: str, token: str, **kw: Any) -> WebClient:
        return cls(base_url, f"Token {token}", **kw)

    def request(self, method: str, path: str, *, retry: bool = True, **kw: Any) -> httpx.Response:
        """The checked response. With ``retry`` (default) connection errors and 5xx are retried
        for the client's window; 4xx raise at once."""
        if not retry:
            return raise_for_status(self.http.request(method, path, **kw))
        for attempt in retrying(self.retry_window_s):
            with attempt:
                return raise_for_status(self.http.request(method, path, **kw))
        raise AssertionError("unreachable")  # pragma: no cover - tenacity re-raises

    def get_json(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw).json()

    def post_json(self, path: str, payload: Any, **kw: Any) -> Any:
        resp = self.request("POST", path, json=payload, **kw)
        return resp.json() if resp.content else {}

    def download(self, path: str, dest: Path) -> None:
        """Stream ``GET path`` into ``dest`` (datasets can be large)."""
        for attempt in retrying(self.retry_window_s):
            with attempt, self.http.stream("GET", path) as resp:
                raise_for_status(resp)
                with dest.open("wb") as fh:
                    for chunk in resp.iter_bytes():
                        fh.write(chunk)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> WebClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
