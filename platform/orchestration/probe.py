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
import time
from dataclasses import dataclass

from training_core.transport.rollout_client import RolloutClient


@dataclass(frozen=True)
class ProbeResult:
    infos: list[dict | None]  # per server: its /model_info, None where it did not answer
    seconds: float  # what this poll cost


async def probe_async(urls: list[str], *, timeout_s: float = 5.0, concurrency: int = 64,
                      api_key: str | None = None) -> list[dict | None]:
    """Per server (in ``urls``' order): its ``/model_info``, ``{}`` when it answers without
    one, None when it does not answer in ``timeout_s``. Over the rollout transport (what
    generation goes over), through the client's monitoring round, with the run's server key
    (``/model_info`` wants it, unlike ``/health``)."""
    client = RolloutClient(urls, timeout_s=timeout_s, api_key=api_key)
    try:
        infos = await client.server_infos(path="/model_info", timeout_s=timeout_s,
                                          concurrency=concurrency)
    finally:
        await client.aclose()
    return [infos[u.rstrip("/")] for u in urls]


def probe(urls: list[str], *, timeout_s: float = 5.0, concurrency: int = 64,
          api_key: str | None = None) -> ProbeResult:
    """Every server's ``/model_info`` in one bounded, concurrent round (from sync code)."""
    start = time.monotonic()
    infos = asyncio.run(probe_async(urls, timeout_s=timeout_s, concurrency=concurrency,
                                    api_key=api_key)) if urls else []
    return ProbeResult(infos, time.monotonic() - start)
