"""One health probe of every rollout server of a run, concurrently and bounded.

The supervise loop asks every server's ``/model_info`` each poll. Asked one after another, a
poll costs the sum of the answers and one hung node stalls it by its whole timeout per request;
asked together (at most ``concurrency`` in flight), a poll costs about the slowest answer, never
more than ``ceil(n / concurrency) * timeout_s``, whatever the servers do.

Not ``/health``: SGLang's health check generates a token and fails while generation is paused
for a weight push; ``/model_info`` answers then too, with the version the server serves.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from training_core.engines.json_http import JsonHttpClient


@dataclass(frozen=True)
class ProbeResult:
    infos: list[dict | None]  # per server: its /model_info, None where it did not answer
    seconds: float  # what this poll cost


async def probe_async(urls: list[str], *, timeout_s: float = 5.0,
                      concurrency: int = 64) -> list[dict | None]:
    limit = asyncio.Semaphore(max(concurrency, 1))
    # The rollout transport (training_core.engines.json_http): what generation goes over.
    client = JsonHttpClient(timeout_s=timeout_s, connect_timeout_s=timeout_s)

    async def one(url: str) -> dict | None:
        async with limit:
            try:
                # the whole exchange is bounded, not each read: a server trickling bytes
                # cannot hold the poll past timeout_s
                status, data = await asyncio.wait_for(client.get(url + "/model_info"), timeout_s)
            except (httpx.HTTPError, TimeoutError, OSError):
                return None
        if status != 200:
            return None
        try:
            body = json.loads(data)
        except ValueError:  # it answers, without a version to report
            return {}
        return body if isinstance(body, dict) else {}

    try:
        return list(await asyncio.gather(*(one(u) for u in urls)))
    finally:
        await client.aclose()


def probe(urls: list[str], *, timeout_s: float = 5.0, concurrency: int = 64) -> ProbeResult:
    """Every server's ``/model_info`` in one bounded, concurrent round (from sync code)."""
    start = time.monotonic()
    infos = asyncio.run(probe_async(urls, timeout_s=timeout_s, concurrency=concurrency)) if urls \
        else []
    return ProbeResult(infos, time.monotonic() - start)
