"""The staleness bounds, both of them: admission control (how many new episodes may start) and
the strict per-token bound applied when a batch is taken (the rollout executor calls
:func:`too_stale` and :func:`last_chance`; the bound's default is :func:`token_bound`).

Counters are in prompt groups. With B groups per batch, max staleness eta, at most M episodes
in flight, ``accepted`` groups accepted since the start and ``running`` in flight, a new episode
may start only while

    capacity = min(M - running, (eta + v + 1) * B - (accepted + running)) > 0

What it bounds: the batch consumed at version v is made of the next B accepted groups, oldest
first. A group started while the policy is at version u gets a start number below
(eta + u + 1) * B, so *if groups finish in the order they started* it is consumed at a version
<= eta + u: its data are at most eta versions old. With eta = 0 no group for batch v+1 can start
before version v+1 exists, which is synchronous RL.

What it does not bound: a straggler (a long generation) can finish after many groups that started
later; they are consumed first, and the straggler can end up more than eta versions behind. The
strict bound is applied at consume time instead (:func:`too_stale`,
``rollout.max_token_staleness``, equal to eta by default): a sample whose oldest token is too old leaves the loss. Admission
control keeps the typical lag low; the consume-time check makes the bound hold always.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessStats:
    submitted: int
    accepted: int
    rejected: int
    running: int


class StalenessManager:
    """Thread-safe counters. The executor calls ``on_submitted`` / ``on_accepted`` /
    ``on_rejected`` as episodes start and end and ``recover`` on resume; ``capacity`` is the
    admission rule. No model, no I/O: unit-testable in isolation."""

    def __init__(self, *, batch_groups: int, max_staleness: int, max_concurrent: int):
        if batch_groups < 1 or max_concurrent < 1 or max_staleness < 0:
            raise ValueError("batch_groups and max_concurrent must be >= 1, max_staleness >= 0")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self._lock = threading.Lock()
        self._submitted = 0
        self._accepted = 0
        self._rejected = 0
        self._running = 0

    def capacity(self, version: int) -> int:
        with self._lock:
            by_concurrency = self.max_concurrent - self._running
            by_staleness = (self.max_staleness + version + 1) * self.batch_groups - (
                self._accepted + self._running
            )
            return min(by_concurrency, by_staleness)

    def on_submitted(self) -> None:
        with self._lock:
            self._submitted += 1
            self._running += 1

    def on_accepted(self) -> None:
        with self._lock:
            self._running -= 1
            self._accepted += 1

    def on_rejected(self) -> None:
        # A rejected episode (workflow returned None, dynamic filter) frees its slot and does
        # not count towards a batch, so another episode can take its place.
        with self._lock:
            self._running -= 1
            self._rejected += 1

    def recover(self, version: int) -> None:
        """On resume at version v, v*B groups have been consumed: restore that as accepted."""
        with self._lock:
            self._accepted = version * self.batch_groups
            self._running = 0

    def stats(self) -> StalenessStats:
        with self._lock:
            return StalenessStats(self._submitted, self._accepted, self._rejected, self._running)


def token_bound(max_staleness: int, max_token_staleness: int | None) -> int:
    """``rollout.max_token_staleness``, the admission bound eta where unset."""
    return max_staleness if max_token_staleness is None else max_token_staleness


def too_stale(oldest_version: int, version: int, bound: int | None) -> bool:
    """Whether a sample whose oldest output token came from ``oldest_version`` leaves the loss
    of the batch trained at ``version`` (None: no per-token bound)."""
    return bound is not None and oldest_version < version - bound


def last_chance(started_version: int, version: int, bound: int | None) -> bool:
    """Whether an episode started at ``started_version`` can only be trained on in the batch
    taken at ``version``: in any later batch :func:`too_stale` would drop it."""
    return bound is not None and started_version == version - bound
