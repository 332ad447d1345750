"""The rollout executor with a scripted engine: admission control, oldest-first batches, dynamic
filtering and the strict per-token staleness bound (no model, no server)."""

from __future__ import annotations

import asyncio
import time

import pytest

from training_core.api import GenerationResponse, Trajectory, TrajectoryGroup
from training_core.data.datasets import PromptLoader
from training_core.rollout import RolloutExecutor
from training_core.staleness import StalenessManager


class ScriptedEngine:
    """Stands in for RolloutClient: versions are set by the test, generation takes `delay`."""

    def __init__(self):
        self._version = 0
        self.max_in_flight = 0
        self.in_flight = 0

    @property
    def version(self):
        return self._version

    def set_version(self, v):
        self._version = v

    async def aclose(self):
        pass


class ScriptedWorkflow:
    def __init__(self, delays, reward_of=lambda item: float(item["i"] % 2)):
        self.delays = delays
        self.reward_of = reward_of

    async def arun_episode(self, engine, item):
        engine.in_flight += 1
        engine.max_in_flight = max(engine.max_in_flight, engine.in_flight)
        started = engine.version
        await asyncio.sleep(self.delays(item))
        engine.in_flight -= 1
        if item.get("reject"):
            return None
        sample = Trajectory([1, 2], [0, 1], [0.0, -0.5], [-1, started], self.reward_of(item))
        other = Trajectory([1, 3], [0, 1], [0.0, -0.5], [-1, started], 1.0 - self.reward_of(item))
        return TrajectoryGroup([sample, other])


def _executor(rows, workflow, *, B=2, eta=1, M=4, **kw):
    engine = ScriptedEngine()
    ex = RolloutExecutor(engine, workflow, PromptLoader(rows, seed=0),
                         StalenessManager(batch_groups=B, max_staleness=eta, max_concurrent=M), **kw)
    ex.start()
    return engine, ex


def test_batches_come_oldest_first_and_respect_concurrency():
    rows = [{"i": i} for i in range(50)]
    engine, ex = _executor(rows, ScriptedWorkflow(lambda item: 0.01 * (item["i"] % 3)), M=3)
    try:
        seen = []
        for v in range(5):
            batch = ex.prepare_batch(2, v, timeout_s=10)
            seen += [g.accepted_at for g in batch.groups]
            engine.set_version(v + 1)
            ex.kick()
        assert seen == sorted(seen)
        assert engine.max_in_flight <= 3
    finally:
        ex.stop()


def test_staleness_zero_never_starts_the_next_batch_early():
    rows = [{"i": i} for i in range(50)]
    engine, ex = _executor(rows, ScriptedWorkflow(lambda item: 0.001), B=2, eta=0, M=100)
    try:
        batch = ex.prepare_batch(2, 0, timeout_s=10)
        time.sleep(0.2)  # plenty of time to (wrongly) start more
        assert ex.staleness.stats().submitted == 2
        assert all(s.versions[-1] == 0 for g in batch.groups for s in g.samples)
        engine.set_version(1)
        ex.kick()
        batch = ex.prepare_batch(2, 1, timeout_s=10)
        assert all(s.versions[-1] == 1 for g in batch.groups for s in g.samples)
    finally:
        ex.stop()


def test_dynamic_filter_rejects_all_equal_groups():
    rows = [{"i": i} for i in range(50)]
    wf = ScriptedWorkflow(lambda item: 0.001, reward_of=lambda item: 0.5)  # rewards 0.5 / 0.5
    engine, ex = _executor(rows, wf, dynamic_filter=True)
    try:
        with pytest.raises(TimeoutError):
            ex.prepare_batch(2, 0, timeout_s=0.5)
        assert ex.staleness.stats().rejected >= 2
    finally:
        ex.stop()


def test_rejected_episodes_are_replaced():
    rows = [{"i": i, "reject": i % 10 != 0} for i in range(50)]
    engine, ex = _executor(rows, ScriptedWorkflow(lambda item: 0.001), eta=0)
    try:
        batch = ex.prepare_batch(2, 0, timeout_s=10)
        assert len(batch.groups) == 2
        assert ex.staleness.stats().rejected >= 1
    finally:
        ex.stop()


def test_strict_token_staleness_drops_stragglers_at_consume_time():
    # The first episode is slow: started at version 0, it is consumed several versions later.
    rows = [{"i": i} for i in range(200)]
    calls = []

    def delay(item):
        calls.append(item)
        return 0.3 if len(calls) == 1 else 0.05

    engine, ex = _executor(rows, ScriptedWorkflow(delay),
                           B=1, eta=1, M=4, max_token_staleness=1)
    try:
        dropped = 0
        for v in range(12):
            batch = ex.prepare_batch(1, v, timeout_s=10)
            dropped += batch.dropped_stale_samples
            for g in batch.groups:
                for s in g.samples:
                    if not s.info.get("dropped_stale"):
                        assert v - s.versions[-1] <= 1
            engine.set_version(v + 1)
            ex.kick()
        assert dropped >= 1
    finally:
        ex.stop()


def test_episode_errors_surface_in_the_trainer():
    class Broken:
        async def arun_episode(self, engine, item):
            raise ValueError("bug in workflow")

    engine, ex = _executor([{"i": 0}], Broken())
    try:
        with pytest.raises(RuntimeError, match="episode failed"):
            ex.prepare_batch(1, 0, timeout_s=10)
    finally:
        ex.stop()


def test_generation_response_is_plain_data():
    r = GenerationResponse([1], [2], [-0.1], [0], "stop")
    assert r.interruptions == 0
