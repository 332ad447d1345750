"""Score rewards off the event loop, each call inside the sandbox jail (training_core/sandbox.py).

One pool for every reward: ``workers`` persistent jailed workers, each scoring one call at a
time. A reward that raises scores 0 and is recorded; one that runs past ``timeout_s``, floods its
answer or dies has its whole jail killed and replaced, so one bad sample cannot poison the calls
queued behind it, and the run goes on.

The trainer never imports reward code it did not ship: a ``module:function`` reward (the user's
code, written into the run directory by the web app, or a path an admin configured) is read from
its file, not imported, and runs as source in the jail. It must be a self-contained module
(standard library and the jail runtime's packages: ``training_core/jail/runtime.py``). Built-in
rewards are Oolong's own code; the jail runs them too (``executor: inline`` scores built-ins
in-process, for rewards too cheap to ship out).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training_core.imports import import_string
from training_core.jail import check_available
from training_core.reward_failures import OUT_OF_RANGE
from training_core.rewards.bounds import REWARD_MAX_ABS, reward_value_problem
from training_core.rewards.registry import parse_reward_path, resolve_reward
from training_core.sandbox import ERROR_CHARS, JailedWorker, Limits, failure_message

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    reward: float
    error: str | None = None
    elapsed_s: float = 0.0
    extracted: str | None = None  # the answer a built-in reward extracted and scored


def module_source(module: str) -> str:
    """The source of ``package.module`` found on ``sys.path``, without importing anything."""
    rel = Path(*module.split("."))
    for entry in sys.path:
        for candidate in (Path(entry or ".") / rel.with_suffix(".py"),
                          Path(entry or ".") / rel / "__init__.py"):
            if candidate.is_file():
                return candidate.read_text()
    raise ValueError(f"reward.fn: module {module!r} is not a file on the path (a function reward "
                     "must be a self-contained module)")


def jailed_reward(fn_path: str, extract: str) -> tuple[dict[str, Any], str | None]:
    """What a jailed worker needs to score ``fn_path``: its spec, and the source of user code."""
    kind, name = parse_reward_path(fn_path, extract)
    if kind == "builtin":
        resolve_reward(fn_path, extract)  # fail fast: an unknown built-in or extractor is named
        return {"kind": "builtin", "path": fn_path, "extract": extract}, None
    return {"kind": "source", "entrypoint": name}, module_source(kind)


class RewardPool:
    """``await pool.score(completion, item)`` -> RewardResult."""

    def __init__(self, fn_path: str, *, workers: int = 1, timeout_s: float = 10.0,
                 executor: str = "process", remote_backend: str | None = None,
                 extract: str = "auto", limits: Limits = Limits(),
                 max_abs: float = REWARD_MAX_ABS):
        self.fn_path = fn_path
        self.max_abs = max_abs
        self.extract = extract
        self.timeout_s = timeout_s
        self.executor = executor
        self.limits = limits
        self.failures = 0
        self._remote = None
        self._inline_fn = None
        if executor == "remote":
            # Loaded by import path: the engine knows no queue library.
            backend = import_string(remote_backend or "", field="reward.remote_backend", kind="class")
            _, source = jailed_reward(fn_path, extract)  # names a bad path or extractor here
            # The call's deadline and memory travel with the task: the worker's jail holds them.
            # memory_mb only where it is not the jail's default, so a backend written before it
            # still loads for runs that keep the default (docs/rewards-and-jail.md: the interface)
            extra = {} if limits.memory_mb == Limits.memory_mb else {"memory_mb": limits.memory_mb}
            try:
                self._remote = backend(fn_path, timeout_s=timeout_s, extract=extract,
                                       source=source, **extra)
            except TypeError as exc:
                if not extra:
                    raise
                raise ValueError(f"reward.memory_mb: the remote backend {remote_backend!r} does "
                                 f"not take memory_mb ({exc})") from exc
            return
        self._spec, self._source = jailed_reward(fn_path, extract)
        if executor == "process":
            check_available()  # said at start: no jail as specified here, no reward code run
        if executor == "inline":
            if self._source is not None:
                raise ValueError("reward.executor 'inline' scores built-in rewards only: reward "
                                 "code runs in the sandbox jail (use executor 'process')")
            self._inline_fn = resolve_reward(fn_path, extract)
        self._n = workers
        self._workers: list[JailedWorker] = []
        self._idle: asyncio.Queue[JailedWorker] | None = None
        self._threads = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="reward")

    @classmethod
    def from_spec(cls, spec: Any) -> RewardPool:
        """The pool a run's ``reward`` section asks for (config.RewardSpec)."""
        return cls(spec.fn, workers=spec.workers, timeout_s=spec.timeout_s,
                   executor=spec.executor, remote_backend=spec.remote_backend,
                   extract=spec.extract, limits=Limits.with_memory(spec.memory_mb),
                   max_abs=spec.max_abs)

    def _start_worker(self) -> JailedWorker:
        worker = JailedWorker(self._spec, source=self._source, limits=self.limits)
        self._workers.append(worker)
        return worker

    async def _idle_queue(self) -> asyncio.Queue[JailedWorker]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            loop = asyncio.get_running_loop()
            for _ in range(self._n):
                self._idle.put_nowait(await loop.run_in_executor(self._threads, self._start_worker))
        return self._idle

    async def score(self, completion: str, item: dict[str, Any]) -> RewardResult:
        start = time.perf_counter()
        if self._remote is not None:
            try:
                reward, error = await self._remote.score(completion, item)
            except Exception as exc:  # noqa: BLE001 - a lost remote call scores 0, the run goes on
                return self._failed(f"remote reward failed: {type(exc).__name__}: {exc}", start)
            if error:
                return self._failed(str(error)[:ERROR_CHARS], start)
            return self._checked(reward, start)
        if self._inline_fn is not None:
            try:
                value = float(self._inline_fn(completion, item))
            except Exception as exc:  # noqa: BLE001
                return self._failed(f"{type(exc).__name__}: {exc}", start)
            return self._checked(value, start, self._inline_fn.extracted(completion))
        idle = await self._idle_queue()
        worker = await idle.get()
        loop = asyncio.get_running_loop()
        try:
            status, answer = await loop.run_in_executor(
                self._threads, worker.call, completion, item, self.timeout_s)
        finally:
            if worker.alive:
                idle.put_nowait(worker)
            else:  # killed (timeout, flood) or dead: a fresh jail takes its place
                self._workers.remove(worker)
                idle.put_nowait(await loop.run_in_executor(self._threads, self._start_worker))
        if status != "ok":
            return self._failed(failure_message(status, self.timeout_s, self.limits,
                                                worker.returncode), start)
        if "error" in answer:
            return self._failed(answer["error"], start)
        return self._checked(answer["reward"], start, answer.get("extracted"))

    def _checked(self, value: Any, start: float, extracted: str | None = None) -> RewardResult:
        """Every reward enters here, whatever executed it: a finite number within
        ``reward.max_abs``, or a failed sample that names the value (a reward of 1e39 overflowed
        the float32 advantages: every parameter NaN, and the run still 'succeeded')."""
        problem = reward_value_problem(value, self.max_abs)
        if problem is not None:
            return self._failed(f"{OUT_OF_RANGE}: reward.fn {self.fn_path!r} {problem}", start)
        return RewardResult(float(value), None, time.perf_counter() - start, extracted)

    def _failed(self, error: str, start: float) -> RewardResult:
        self.failures += 1
        log.warning("reward %s failed (scored 0): %s", self.fn_path, error)
        return RewardResult(0.0, error, time.perf_counter() - start)

    def close(self) -> None:
        if self._remote is not None:
            close = getattr(self._remote, "close", None)
            if close is not None:
                close()
            return
        for worker in self._workers:
            worker.kill()
        self._workers.clear()
        self._threads.shutdown(wait=False)
