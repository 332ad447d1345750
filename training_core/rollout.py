"""The rollout executor: many concurrent episodes on a background event loop.

The trainer thread calls :meth:`RolloutExecutor.prepare_batch`; meanwhile the executor's own
thread keeps starting episodes as long as the staleness manager allows (see staleness.py), so
generation never waits for training. Finished groups queue oldest-first.

Consume-time filters:
- DAPO dynamic filtering: a group whose rewards are all equal is rejected when it finishes
  (it frees its slot, another prompt takes its place).
- Strict per-token staleness (optional): a sample whose oldest output token is older than
  ``v - max_token_staleness`` is dropped from the loss when the batch is taken (its reward still
  counts in its group's baseline).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training_core.algorithms.advantages import is_degenerate_group
from training_core.api import TrajectoryGroup
from training_core.data.datasets import PromptLoader
from training_core.engines.rollout_client import RolloutClient
from training_core.staleness import StalenessManager

log = logging.getLogger(__name__)


@dataclass
class Batch:
    groups: list[TrajectoryGroup]
    dropped_stale_samples: int
    wait_s: float
    queue_depth: int
    rejected_groups: int


class RolloutExecutor:
    def __init__(self, client: RolloutClient, workflow: Any, loader: PromptLoader,
                 staleness: StalenessManager, *, dynamic_filter: bool = False,
                 max_token_staleness: int | None = None):
        self.client = client
        self.workflow = workflow
        self.loader = loader
        self.staleness = staleness
        self.dynamic_filter = dynamic_filter
        self.max_token_staleness = max_token_staleness
        self._done: deque[TrajectoryGroup] = deque()
        self._cond = threading.Condition()
        self._errors: list[BaseException] = []
        self._rejected_since_batch = 0
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run_loop, name="rollout", daemon=True)
        self.on_group: Callable[[TrajectoryGroup], None] | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(lambda: self._wake and self._wake.set())
            self._thread.join(timeout=30)

    def run_coro(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine (pause, weight update, ...) on the executor's loop from the trainer."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- the loop thread --------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._submit_forever())
        self._loop.run_until_complete(self.client.aclose())

    def kick(self) -> None:
        """Re-check capacity now (the version changed)."""
        self._loop.call_soon_threadsafe(lambda: self._wake and self._wake.set())

    async def _submit_forever(self) -> None:
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        while not self._stopping:
            while self.staleness.capacity(self.client.version) > 0 and not self._stopping:
                index, item = self.loader.next()
                self.staleness.on_submitted()
                task = asyncio.create_task(self._episode(index, item))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
            except TimeoutError:
                pass
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _episode(self, index: int, item: dict[str, Any]) -> None:
        try:
            group = await self.workflow.arun_episode(self.client, item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # an episode bug must surface in the trainer, not vanish
            log.exception("episode failed")
            self.staleness.on_rejected()
            with self._cond:
                self._errors.append(exc)
                self._cond.notify_all()
            return
        finally:
            if self._wake is not None:
                self._wake.set()
        if group is None or (self.dynamic_filter and is_degenerate_group(group.rewards)):
            self.staleness.on_rejected()
            with self._cond:
                self._rejected_since_batch += 1
            return
        group.prompt_index = index
        group.accepted_at = time.perf_counter()
        self.staleness.on_accepted()
        if self.on_group is not None:
            self.on_group(group)
        with self._cond:
            self._done.append(group)
            self._cond.notify_all()

    # ---- the trainer side -------------------------------------------------------------------

    def prepare_batch(self, batch_groups: int, version: int, timeout_s: float | None = None) -> Batch:
        """Block until ``batch_groups`` groups are ready; take the oldest."""
        start = time.perf_counter()
        with self._cond:
            while len(self._done) < batch_groups:
                if self._errors:
                    raise RuntimeError("an episode failed") from self._errors[0]
                remaining = None if timeout_s is None else timeout_s - (time.perf_counter() - start)
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no batch of {batch_groups} groups after {timeout_s}s")
                self._cond.wait(timeout=remaining if remaining is not None else 1.0)
            groups = [self._done.popleft() for _ in range(batch_groups)]
            depth = len(self._done)
            rejected, self._rejected_since_batch = self._rejected_since_batch, 0
        dropped = 0
        if self.max_token_staleness is not None:
            oldest_allowed = version - self.max_token_staleness
            for g in groups:
                for s in g.samples:
                    if s.num_output_tokens and s.oldest_version < oldest_allowed:
                        s.loss_mask = [0] * len(s.loss_mask)
                        s.info["dropped_stale"] = True
                        dropped += 1
        return Batch(groups, dropped, time.perf_counter() - start, depth, rejected)
