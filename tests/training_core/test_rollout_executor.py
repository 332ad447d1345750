"""The rollout executor with a scripted engine: admission control, oldest-first batches, dynamic
filtering and the strict per-token staleness bound (no model, no server)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from training_core.api import Trajectory, TrajectoryGroup
from training_core.data.datasets import PromptLoader
from training_core.rollout import RolloutExecutor
from training_core.staleness import StalenessManager

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


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


def _until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Wait on ``condition`` (polled), failing with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.005)


def _executor(rows, workflow, *, B=2, eta=1, M=4, **kw):
    engine = ScriptedEngine()
    ex = RolloutExecutor(engine, workflow, PromptLoader(rows, seed=0),
                         StalenessManager(batch_groups=B, max_staleness=eta, max_concurrent=M), **kw)
    ex.start()
    return engine, ex


def _consume(engine, ex, versions: int, B: int) -> list:
    """The trainer's side: a batch per version, then the next version. [(version, batch, when
    it was asked for)]."""
    batches = []
    for v in range(versions):
        asked = time.perf_counter()
        batches.append((v, ex.prepare_batch(B, v, timeout_s=10), asked))
        engine.set_version(v + 1)
        ex.kick()
    return batches


def test_batches_take_the_earliest_started_ready_groups_and_respect_concurrency():
    rows = [{"i": i} for i in range(50)]
    engine, ex = _executor(rows, ScriptedWorkflow(lambda item: 0.01 * (item["i"] % 3)), M=3)
    try:
        batches = _consume(engine, ex, 5, B=2)
        for _, batch, _ in batches:  # earliest started first; among equals, first finished
            order = [(g.started_version, g.accepted_at) for g in batch.groups]
            assert order == sorted(order)
        # A group taken later but started earlier was not ready yet when the earlier batch was
        # asked for (it was accepted after that).
        for i, (_, earlier, asked) in enumerate(batches):
            for _, later, _ in batches[i + 1:]:
                for g in later.groups:
                    if any(g.started_version < h.started_version for h in earlier.groups):
                        assert g.accepted_at > asked
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


def test_a_straggler_at_its_last_chance_is_waited_for_not_dropped():
    # The first episode is slow: started at version 0, it finishes after several later ones.
    # Batch 1 (version 1 = 0 + eta) is its last chance: the batch waits for it and takes it
    # first (earliest started), so nothing is dropped and every token stays within eta.
    rows = [{"i": i} for i in range(200)]
    calls = []

    def delay(item):
        calls.append(item)
        return 0.3 if len(calls) == 1 else 0.05

    engine, ex = _executor(rows, ScriptedWorkflow(delay),
                           B=1, eta=1, M=4, max_token_staleness=1)
    try:
        taken = []
        for v, batch, _ in _consume(engine, ex, 12, B=1):
            assert batch.dropped_stale_samples == 0
            for g in batch.groups:
                taken.append((v, g.prompt_index))
                for s in g.samples:
                    assert v - s.versions[-1] <= 1
        assert (1, 0) in taken, taken  # the straggler: the first prompt handed out
    finally:
        ex.stop()


def test_groups_due_beyond_one_batch_are_dropped_at_consume_time():
    # B=1, eta=2: two slow episodes start at version 0 with a fast one, and fast ones keep the
    # batches at versions 0 and 1 busy. At version 2 both slow ones are due and the batch holds
    # one: the other is too old for every later batch and leaves the loss.
    rows = [{"i": i} for i in range(200)]
    calls = []

    def delay(item):
        calls.append(item)
        return 0.4 if len(calls) <= 2 else 0.01

    engine, ex = _executor(rows, ScriptedWorkflow(delay),
                           B=1, eta=2, M=8, max_token_staleness=2)
    try:
        dropped = 0
        for v, batch, _ in _consume(engine, ex, 6, B=1):
            dropped += batch.dropped_stale_samples
            for g in batch.groups:
                for s in g.samples:
                    assert s.dropped or v - s.oldest_version <= 2
        assert dropped == 2  # one group of two samples
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


def _straggler_run(max_token_staleness, versions=14, seed=3):
    """B=2, eta=1, M=8; one episode in four is a straggler (10x slower). Returns, per consumed
    sample, (version at consume, oldest token version, dropped)."""
    import random

    rng = random.Random(seed)
    rows = [{"i": i} for i in range(400)]
    delays = {}

    def delay(item):
        return delays.setdefault(item["i"], 0.2 if rng.random() < 0.25 else 0.02)

    engine, ex = _executor(rows, ScriptedWorkflow(delay), B=2, eta=1, M=8,
                           max_token_staleness=max_token_staleness)
    try:
        seen = [(v, s.oldest_version, s.dropped)
                for v, batch, _ in _consume(engine, ex, versions, B=2)
                for g in batch.groups for s in g.samples]
    finally:
        ex.stop()
    return seen


def test_with_stragglers_no_consumed_token_is_older_than_eta():
    from training_core.config import RunSpec

    eta = 1
    # The admission formula alone lets stragglers through (completion out of order) ...
    unbounded = _straggler_run(max_token_staleness=None)
    assert max(v - oldest for v, oldest, _ in unbounded) > eta
    # ... the consume-time bound, on by default at eta, keeps every trained token within eta.
    bound = RunSpec.model_validate({"rollout": {"max_staleness": eta}}).rollout.token_staleness_bound
    assert bound == eta
    bounded = _straggler_run(max_token_staleness=bound)
    assert all(v - oldest <= eta for v, oldest, dropped in bounded if not dropped)
    # Batches wait for a straggler at its last chance, so it is trained on, not dropped.
    assert sum(dropped for _, _, dropped in bounded) <= len(bounded) // 10


def test_an_episode_error_is_counted_and_the_run_goes_on():
    from training_core.api import GenerationAborted

    class FailsOnThree(ScriptedWorkflow):
        async def arun_episode(self, engine, item):
            if item["i"] % 5 == 3:
                raise GenerationAborted("server aborted the request: input too long")
            return await super().arun_episode(engine, item)

    rows = [{"i": i} for i in range(20)]
    engine, ex = _executor(rows, FailsOnThree(lambda item: 0.001), B=2, eta=0, M=4)
    failures = []
    try:
        for v in range(4):
            batch = ex.prepare_batch(2, v, timeout_s=10)
            failures += batch.episode_failures
            assert len(batch.groups) == 2
            engine.set_version(v + 1)
            ex.kick()
    finally:
        ex.stop()
    assert failures and all(ex.loader.row(f.prompt_index)["i"] % 5 == 3 for f in failures)
    assert "input too long" in failures[0].message


def test_a_stalled_batch_fails_with_the_reason():
    from training_core.api import RequestRejected
    from training_core.rollout import BatchTimeout

    rows = [{"i": i} for i in range(50)]
    wf = ScriptedWorkflow(lambda item: 0.001, reward_of=lambda item: 0.5)
    engine, ex = _executor(rows, wf, dynamic_filter=True)
    try:
        with pytest.raises(BatchTimeout, match="no batch for 1 s: every group rejected by the dynamic filter"):
            ex.prepare_batch(2, 0, timeout_s=1)
    finally:
        ex.stop()

    class Rejected:
        async def arun_episode(self, engine, item):
            await asyncio.sleep(0.001)
            raise RequestRejected("http://127.0.0.2:1/generate -> 400: bad request")

    engine, ex = _executor(rows, Rejected())
    try:
        with pytest.raises(BatchTimeout, match="every episode failed .* 400: bad request"):
            ex.prepare_batch(2, 0, timeout_s=1)
    finally:
        ex.stop()


def test_resume_state_holds_prompts_handed_out_but_not_trained_on():
    rows = [{"i": i} for i in range(50)]
    engine, ex = _executor(rows, ScriptedWorkflow(lambda item: 0.001), B=2, eta=0, M=100)
    try:
        batch = ex.prepare_batch(2, 0, timeout_s=10)
        engine.set_version(1)
        ex.kick()
        # the next batch's episodes start (eta=0: exactly B of them): waited for, not slept on
        _until(lambda: ex.staleness.stats().submitted == 4, "the next batch's episodes to start")
        state = ex.resume_state()
    finally:
        ex.stop()
    consumed = sorted(g.prompt_index for g in batch.groups)
    assert consumed == [0, 1]
    assert state == {"loader_position": 4, "pending_prompts": [2, 3]}
    # A resumed loader hands out exactly those again, then continues the stream.
    loader = PromptLoader(rows, seed=0)
    loader.restore(state["loader_position"], state["pending_prompts"])
    fresh = PromptLoader(rows, seed=0)
    expected = [fresh.next() for _ in range(6)][2:]
    assert [loader.next() for _ in range(4)] == expected


def test_dropping_a_stale_sample_changes_no_other_sample():
    from training_core.algorithms.presets import PRESETS
    from training_core.batching import build_train_batch

    def group():
        long = Trajectory([1, 2, 3, 4], [0, 1, 1, 1], [0, -1, -1, -1], [-1, 0, 0, 0], 1.0)
        short = Trajectory([1, 2], [0, 1], [0, -1], [-1, 5], 0.0)
        return TrajectoryGroup([long, short])

    kept, dropped = group(), group()
    dropped.samples[0].dropped = True
    dapo = PRESETS["dapo"]
    a = build_train_batch([kept], pad_id=0, algo=dapo, max_new_tokens=4)
    b = build_train_batch([dropped], pad_id=0, algo=dapo, max_new_tokens=4)
    # The other sample's advantage (baseline and overlong penalty included) is unchanged ...
    assert torch.equal(a.advantages[1], b.advantages[1])
    # ... and only the dropped sample leaves the loss.
    assert b.loss_mask[0].sum() == 0 and torch.equal(a.loss_mask[1], b.loss_mask[1])
    # Its tokens still count in the staleness metrics: the lag of the stale sample shows.
    from training_core.step_metrics import batch_metrics

    assert batch_metrics([dropped], version=5, algo=dapo)["staleness/max"] == 5
