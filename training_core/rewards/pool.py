"""Run rewards off the event loop: in worker processes with a per-call timeout.

A reward that raises or runs past its timeout scores 0 and is recorded; it never kills the run.
A worker that timed out is killed and replaced (the call may be stuck in C code or a loop), so
one bad sample cannot poison the calls queued behind it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from training_core.imports import import_string
from training_core.rewards.registry import resolve_reward

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    reward: float
    error: str | None = None
    elapsed_s: float = 0.0
    extracted: str | None = None  # the answer a built-in reward extracted and scored


def _worker_main(conn: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cache: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        path, extract, completion, item = msg
        try:
            key = f"{path}|{extract}"
            fn = cache.get(key) or cache.setdefault(key, resolve_reward(path, extract))
            conn.send(("ok", (float(fn(completion, item)), fn.extracted(completion))))
        except BaseException as exc:  # noqa: BLE001 - report everything, keep serving
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, ctx: Any):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def call(self, msg: tuple, timeout: float) -> tuple[str, Any]:
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            return ("timeout", None)
        try:
            return self.conn.recv()
        except EOFError:
            return ("error", "reward worker died")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    """``await pool.score(completion, item)`` -> RewardResult. ``executor='inline'`` skips processes."""

    def __init__(self, fn_path: str, *, workers: int = 1, timeout_s: float = 10.0,
                 executor: str = "process", remote_backend: str | None = None,
                 extract: str = "auto"):
        self.fn_path = fn_path
        self.extract = extract
        self.timeout_s = timeout_s
        self.executor = executor
        self.failures = 0
        self._remote = None
        if executor == "remote":
            # Loaded by import path: the engine knows no queue library.
            backend = import_string(remote_backend or "", field="reward.remote_backend", kind="class")
            self._remote = backend(fn_path, timeout_s=timeout_s)
        self._inline_fn = resolve_reward(fn_path, extract)  # fail fast on a bad path
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._idle: asyncio.Queue[_Worker] | None = None
        self._n = workers
        self._threads = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="reward")
        self._lock = threading.Lock()

    def _ensure_started(self) -> asyncio.Queue:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self._n):
                w = _Worker(self._ctx)
                self._workers.append(w)
                self._idle.put_nowait(w)
        return self._idle

    async def score(self, completion: str, item: dict[str, Any]) -> RewardResult:
        start = time.perf_counter()
        if self._remote is not None:
            try:
                reward, error = await self._remote.score(completion, item)
            except Exception as exc:  # noqa: BLE001 - a lost remote call scores 0, the run goes on
                return self._failed(f"remote reward failed: {type(exc).__name__}: {exc}", start)
            if error:
                return self._failed(error, start)
            return RewardResult(reward, None, time.perf_counter() - start)
        if self.executor == "inline":
            try:
                return RewardResult(float(self._inline_fn(completion, item)), None,
                                    time.perf_counter() - start,
                                    self._inline_fn.extracted(completion))
            except Exception as exc:  # noqa: BLE001
                return self._failed(f"{type(exc).__name__}: {exc}", start)
        idle = self._ensure_started()
        worker = await idle.get()
        loop = asyncio.get_running_loop()
        status, value = await loop.run_in_executor(
            self._threads, worker.call, (self.fn_path, self.extract, completion, item),
            self.timeout_s)
        if status == "ok":
            idle.put_nowait(worker)
            reward, extracted = value
            return RewardResult(reward, None, time.perf_counter() - start, extracted)
        if status == "timeout" or not worker.proc.is_alive():
            worker.kill()
            self._workers.remove(worker)
            fresh = _Worker(self._ctx)
            self._workers.append(fresh)
            idle.put_nowait(fresh)
            value = value or f"timed out after {self.timeout_s:g}s"
        else:
            idle.put_nowait(worker)
        return self._failed(value, start)

    def _failed(self, error: str, start: float) -> RewardResult:
        self.failures += 1
        log.warning("reward %s failed (scored 0): %s", self.fn_path, error)
        return RewardResult(0.0, error, time.perf_counter() - start)

    def close(self) -> None:
        if self._remote is not None and hasattr(self._remote, "close"):
            self._remote.close()
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            w.kill()
        self._workers.clear()
        self._threads.shutdown(wait=False)
