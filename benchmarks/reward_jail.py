"""Reward scoring throughput: the jailed pool (every reward in a bubblewrap jail, persistent
workers) against the unsandboxed design it replaced (one spawned process per slot, called from
the event loop through a thread over a multiprocessing Pipe), same built-in reward, same calls,
same machine, measured side by side.

    python benchmarks/reward_jail.py [--quick] --out bench-results/reward_jail.json

Writes {"calls": N, "unsandboxed_calls_per_s": ..., "jailed_calls_per_s": ..., "ratio":
unsandboxed/jailed (the slowdown; issue 11 aims at <= 2), "jail_start_s": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training_core.data.synthetic import arithmetic_items  # noqa: E402
from training_core.rewards.pool import RewardPool  # noqa: E402

REWARD = "builtin:arithmetic"


def _pipe_worker(conn) -> None:  # the old design: resolve once, then call per message
    from training_core.rewards.registry import resolve_reward

    fn = resolve_reward(REWARD)
    while (msg := conn.recv()) is not None:
        completion, item = msg
        conn.send((float(fn(completion, item)), fn.extracted(completion)))


def unsandboxed(calls: list[tuple[str, dict]]) -> float:
    """As the old RewardPool called its worker: from the event loop through a thread, one call
    in flight per worker, over a Pipe."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pipe_worker, args=(child,), daemon=True)
    proc.start()

    def call(msg):
        parent.send(msg)
        return parent.recv()

    async def go() -> float:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=1) as threads:
            await loop.run_in_executor(threads, call, calls[0])  # warm: imports are not measured
            start = time.perf_counter()
            for msg in calls:
                await loop.run_in_executor(threads, call, msg)
            return time.perf_counter() - start

    elapsed = asyncio.run(go())
    parent.send(None)
    proc.join(5)
    return elapsed


def jailed(calls: list[tuple[str, dict]]) -> tuple[float, float]:
    async def go() -> tuple[float, float]:
        pool = RewardPool(REWARD, workers=1, timeout_s=10)
        try:
            begin = time.perf_counter()
            await pool.score(*calls[0])  # starts the jail
            started = time.perf_counter() - begin
            start = time.perf_counter()
            for completion, item in calls:
                await pool.score(completion, item)
            return time.perf_counter() - start, started
        finally:
            pool.close()

    return asyncio.run(go())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="bench-results/reward_jail.json")
    args = parser.parse_args()
    n = 500 if args.quick else 3000
    items = arithmetic_items(n, seed=0)
    calls = [(str(it["answer"]) if i % 2 else "0", it) for i, it in enumerate(items)]
    plain = unsandboxed(calls)
    jail, start_s = jailed(calls)
    result = {"calls": n, "reward": REWARD, "unsandboxed_calls_per_s": n / plain,
              "jailed_calls_per_s": n / jail, "ratio": jail / plain, "jail_start_s": start_s,
              "quick": args.quick}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
