"""The policy version: one owner per trainer process.

``v`` starts at 0 (or at a checkpoint's version on resume) and grows by one per optimizer update
whose weights the rollout servers hold (docs/design.md §3). It is advanced in one place,
:func:`training_core.transport.weight_sync.push_weights`, between the push and the resume of generation,
and read by everything else:

- admission: the rollout executor's staleness capacity (through ``RolloutClient.version``);
- routing: a server answering with an older ``weight_version`` is not sent requests;
- the loop: a batch's staleness, the checkpoint's client state (what a resume starts from);
- restarts: the push records the live version in ``weights/CURRENT`` of the run directory, which
  the flow reads to bring a restarted server up to date.
"""

from __future__ import annotations

import threading


class PolicyVersion:
    """A thread-safe counter: written by the trainer's control thread, read by the executor's."""

    def __init__(self, start: int = 0):
        if start < 0:
            raise ValueError(f"a policy version is >= 0, not {start}")
        self._value = start
        self._lock = threading.Lock()

    @property
    def current(self) -> int:
        return self._value  # an int read is atomic; the lock orders writers

    def advance(self) -> int:
        """The next version, once the servers hold its weights; returns it."""
        with self._lock:
            self._value += 1
            return self._value

    def __repr__(self) -> str:
        return f"PolicyVersion({self._value})"
