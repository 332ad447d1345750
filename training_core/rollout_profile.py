"""The rollout side of the per-step profile, from each server's ``/server_info`` counters (the
embedded server's; a server without them, such as SGLang, adds nothing): how busy the servers
were, their mean decode batch and their tokens/s since the last step. Next to the trainer's
``time/*`` it shows which side is the bottleneck.

Measured on a thread of its own, through the rollout client's transport: a server busy decoding
answered slowly (~50 ms, when its event loop shared the GIL with the decode loop), and that wait
was a fifth of an asynchronous step; SGLang, or a server far away, can be slow too. A step reports
the newest finished measurement, so the numbers come one step late (the first step has none).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from training_core import metric_names as M
from training_core.transport.rollout_client import RolloutClient

COUNTERS = ("busy_s", "tokens_generated", "steps")


class RolloutProfile:
    def __init__(self, client: RolloutClient):
        self.client = client
        self.urls = [s.url for s in client.servers]  # the servers that report counters
        self.last: dict[str, tuple[float, dict[str, Any]]] = {}
        # The client keeps one connection pool per event loop: this thread's loop is its own.
        self._loop = asyncio.new_event_loop()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-profile")
        self._pending: Future | None = None

    def sample(self) -> dict[str, float]:
        """Never waits: the newest finished measurement ({} while one is still under way), and
        the next one started."""
        out: dict[str, float] = {}
        if self._pending is not None:
            if not self._pending.done():
                return out
            out = self._pending.result()
        self._pending = self._worker.submit(self._measure)
        return out

    def close(self) -> None:
        # A measurement under way ends within the client's 2 s timeout.
        self._worker.shutdown(wait=True, cancel_futures=True)
        try:
            self._loop.run_until_complete(self.client.aclose())  # this loop's connections
        finally:
            self._loop.close()

    def _measure(self) -> dict[str, float]:
        infos = self._loop.run_until_complete(self.client.server_infos(set(self.urls)))
        busy, prefill, batch, rate = [], [], [], []
        for url, info in infos.items():
            if info is None:
                continue
            if not all(k in info for k in COUNTERS):
                self.urls.remove(url)  # not an embedded server: never ask it again
                continue
            now = time.perf_counter()
            if url in self.last:
                then, before = self.last[url]
                wall = max(now - then, 1e-9)
                steps = info["steps"] - before["steps"]
                tokens = info["tokens_generated"] - before["tokens_generated"]
                busy.append(min(1.0, (info["busy_s"] - before["busy_s"]) / wall))
                if "prefill_s" in info and "prefill_s" in before:
                    prefill.append(min(1.0, (info["prefill_s"] - before["prefill_s"]) / wall))
                rate.append(tokens / wall)
                if steps > 0:
                    batch.append(tokens / steps)
            self.last[url] = (now, info)
        out = {}
        if busy:
            out[M.SERVER_BUSY_FRAC] = statistics.fmean(busy)
            out[M.SERVER_TOKENS_PER_S] = statistics.fmean(rate)
        if prefill:
            out[M.SERVER_PREFILL_FRAC] = statistics.fmean(prefill)
        if batch:
            out[M.DECODE_BATCH_MEAN] = statistics.fmean(batch)
        return out
