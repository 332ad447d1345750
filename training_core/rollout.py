"""The rollout executor: many concurrent episodes on a background event loop.

The trainer thread calls :meth:`RolloutExecutor.prepare_batch`; meanwhile the executor's own
thread keeps starting episodes as long as the staleness manager allows (see staleness.py), so
generation never waits for training. Finished groups queue oldest-first.

Consume-time filters:
- DAPO dynamic filtering: a group whose rewards are all equal is rejected when it finishes
  (it frees its slot, another prompt takes its place).
- Strict per-token staleness: a sample whose oldest output token is older than
  ``v - max_token_staleness`` is flagged ``dropped`` when the batch is taken: it leaves the loss,
  but keeps its length and reward (its group's baseline and DAPO's overlong penalty do not
  change) and its tokens still count in the staleness metrics.

Which groups a batch takes: finished groups, the earliest started first, and before taking it
waits for every episode still running that this batch is the last one able to take (started at
``v - max_token_staleness``; one batch later its samples would be dropped). Taken in finish
order, a long answer kept losing its place to shorter ones started after it until it was too
old: on the long-tail benchmark, once generation was the bottleneck, about a third of the
samples were dropped, the long ones most (a bias towards short answers). Waiting costs the
trainer time only when a straggler is that late, and generation keeps going meanwhile.

Failures:
- An :class:`~training_core.api.EpisodeError` (the server rejected or aborted
  that one request) is logged and counted; the episode's slot goes to another prompt and the run
  goes on. Any other exception in an episode (a workflow bug, servers unreachable) fails the run.
- ``prepare_batch`` gives up after ``timeout_s`` with a reason: every group rejected by the
  dynamic filter, every episode failing, or nothing finishing at all.

Exact resume: the executor knows which prompts were handed out and are neither consumed nor
rejected (in flight or buffered). :meth:`resume_state` returns them with the loader position,
atomically; a resumed run hands them out again first, so no prompt is skipped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from training_core.algorithms.advantages import is_degenerate_group
from training_core.api import EpisodeError, InferenceEngine, TrajectoryGroup, Workflow
from training_core.data.datasets import PromptLoader
from training_core.staleness import StalenessManager, last_chance, too_stale

log = logging.getLogger(__name__)


class BatchTimeout(TimeoutError):
    """No batch could be assembled in time; the message says why."""


@dataclass
class EpisodeFailure:
    prompt_index: int
    message: str


@dataclass
class Batch:
    groups: list[TrajectoryGroup]
    dropped_stale_samples: int
    wait_s: float
    queue_depth: int
    rejected_groups: int
    episode_failures: list[EpisodeFailure] = field(default_factory=list)


class RolloutExecutor:
    def __init__(self, client: InferenceEngine, workflow: Workflow, loader: PromptLoader,
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
        self._failures_since_batch: list[EpisodeFailure] = []
        self._outstanding: set[int] = set()  # handed out, neither consumed nor rejected
        self._running: dict[int, int] = {}  # episodes in flight: prompt index -> started version
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run_loop, name="rollout", daemon=True)

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
        return self.submit_coro(coro).result(timeout)

    def submit_coro(self, coro: Any) -> concurrent.futures.Future:
        """Start a coroutine on the executor's loop (beside the episodes); the trainer's thread
        goes on and reads the future when it needs the result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def resume_state(self) -> dict[str, Any]:
        """What a checkpoint needs to resume the prompt stream exactly (see the module doc)."""
        with self._cond:
            return {"loader_position": self.loader.position,
                    "pending_prompts": sorted(self._outstanding)}

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
                with self._cond:
                    index, item = self.loader.next()
                    self._outstanding.add(index)
                    self._running[index] = self.client.version
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
        except EpisodeError as exc:  # this request's own failure: count it, go on
            log.warning("episode for prompt %d failed: %s", index, exc)
            self.staleness.on_rejected()
            with self._cond:
                self._running.pop(index, None)
                self._outstanding.discard(index)
                self._failures_since_batch.append(EpisodeFailure(index, str(exc)))
                self._cond.notify_all()
            return
        except BaseException as exc:  # a bug or dead servers must surface in the trainer
            log.exception("episode failed")
            self.staleness.on_rejected()
            with self._cond:
                self._running.pop(index, None)
                self._errors.append(exc)
                self._cond.notify_all()
            return
        finally:
            if self._wake is not None:
                self._wake.set()
        if group is None or (self.dynamic_filter and is_degenerate_group(group.rewards)):
            self.staleness.on_rejected()
            with self._cond:
                self._running.pop(index, None)
                self._outstanding.discard(index)
                self._rejected_since_batch += 1
                self._cond.notify_all()
            return
        group.prompt_index = index
        self.staleness.on_accepted()
        with self._cond:  # in one step: a due episode is either running or ready
            group.started_version = self._running.pop(index)
            group.accepted_at = time.perf_counter()  # when it became ready to take
            self._done.append(group)
            self._cond.notify_all()

    # ---- the trainer side -------------------------------------------------------------------

    def in_flight(self) -> int:
        """Episodes started and not finished: 0 means the servers have nothing to generate."""
        with self._cond:
            return len(self._running)

    def prepare_batch(self, batch_groups: int, version: int, timeout_s: float | None = None) -> Batch:
        """Block until ``batch_groups`` groups are ready and no running episode is due (see the
        module doc); take the earliest started."""
        start = time.perf_counter()
        with self._cond:
            while len(self._done) < batch_groups or self._due(version):
                if self._errors:
                    exc = self._errors[0]
                    raise RuntimeError(f"an episode failed: {type(exc).__name__}: {exc}") from exc
                waited = time.perf_counter() - start
                if timeout_s is not None and waited >= timeout_s:
                    raise BatchTimeout(f"no batch for {timeout_s:.0f} s: {self._stall_reason()}")
                remaining = 1.0 if timeout_s is None else min(1.0, timeout_s - waited)
                self._cond.wait(timeout=remaining)
            # Earliest started first; among equals, finish order (a stable sort).
            ready = sorted(self._done, key=lambda g: g.started_version)
            groups = ready[:batch_groups]
            taken = {id(g) for g in groups}
            self._done = deque(g for g in self._done if id(g) not in taken)
            for g in groups:
                self._outstanding.discard(g.prompt_index)
            depth = len(self._done)
            rejected, self._rejected_since_batch = self._rejected_since_batch, 0
            failures, self._failures_since_batch = self._failures_since_batch, []
        dropped = 0
        for g in groups:
            for s in g.samples:
                if s.num_output_tokens and too_stale(s.oldest_version, version,
                                                     self.max_token_staleness):
                    s.dropped = True
                    dropped += 1
        return Batch(groups, dropped, time.perf_counter() - start, depth, rejected, failures)

    def _due(self, version: int) -> bool:
        """Whether a running episode can only be trained on in this batch (a later one would
        drop it as too stale). Under the lock."""
        return any(last_chance(started, version, self.max_token_staleness)
                   for started in self._running.values())

    def _stall_reason(self) -> str:
        done, rejected, failures = len(self._done), self._rejected_since_batch, self._failures_since_batch
        if failures and not rejected:
            return (f"every episode failed ({len(failures)} since the last batch); last: "
                    f"{failures[-1].message}")
        if rejected and not failures:
            return (f"every group rejected by the dynamic filter ({rejected} groups whose samples "
                    "all got the same reward); make the task easier or larger groups, or turn "
                    "algorithm.dynamic_filter off")
        if rejected or failures:
            return f"{rejected} groups rejected by the dynamic filter, {len(failures)} episodes failed"
        return (f"servers unreachable or too slow: {done} groups finished, "
                f"{self.staleness.stats().running} episodes still running")
