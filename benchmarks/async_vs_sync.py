"""Asynchronous versus synchronous RL on the same model, data, seed and machine.

Both sides run the real stack (embedded rollout server process + DeepSpeed trainer + the async
loop); only ``rollout.max_staleness`` differs: 0 (synchronous RL: generation for batch v+1 starts
only once version v+1 exists) versus > 0. The task has a long-tailed spread of response lengths
(running sums of 2..8 terms, 15% of prompts at the maximum), as reasoning traces do, so a synchronous batch waits for its longest
sample.

    python benchmarks/async_vs_sync.py --quick --out bench-results/async_vs_sync.json

Writes {"sync": {...}, "async": {...}, "speedup": sync_wall / async_wall, ...}.

The machine is shared and its speed drifts (the same synchronous side measured 0.23-0.30 s per
step in runs minutes apart), so one sync run then one async run can land on either side of a
drift. ``--repeats N`` (default 3) runs N pairs, alternating which side goes first, and reports
the median of the per-pair speedups (the lower median for an even N) with every pair's figures
("pairs") and their range; "sync" and "async" are that median pair.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training_core.config import load_spec  # noqa: E402
from training_core.metrics import read_metrics  # noqa: E402

TASK = "{min_terms: 2, max_terms: 8, max_value: 9, long_tail: 0.15}"


def side(name: str, staleness: int, steps: int, initial: Path, out_root: Path, seed: int,
         task: str, overrides: list[str] = ()) -> dict:
    from training_core.train import train

    run_dir = out_root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    link = run_dir / "initial_model"
    if not link.exists():
        link.symlink_to(initial.resolve())
    spec = load_spec(None, [
        f"name={name}", f"seed={seed}", f"run_dir={run_dir}", "model.path=tiny",
        f"data.options={task}", "rollout.max_new_tokens=48", "reward.executor=inline", "rollout.group_size=8", "rollout.max_concurrent=64",
        f"rollout.max_staleness={staleness}", "trainer.batch_groups=8", "trainer.lr=1e-4",
        f"trainer.steps={steps}", "eval.every=0", "checkpoint.every=0", *overrides,
    ])
    result = train(spec, progress=False)
    return side_result([r for r in read_metrics(run_dir) if r["step"] > 0], staleness,
                       result.wall_s)


def side_result(rows: list[dict], staleness: int, total_run_s: float) -> dict:
    """One side's figures from its metric rows (steps > 0)."""
    # Wall time of the training loop itself (from the first batch to the last step), the same
    # measure on both sides: server start-up and DeepSpeed init are excluded.
    wall = sum(r["time/step_s"] for r in rows)
    tokens = sum(r["tokens/consumed"] for r in rows)
    quarter = max(3, len(rows) // 4)
    return {
        "max_staleness": staleness,
        "steps": len(rows),
        "wall_s": wall,
        "effective_tokens_per_s": tokens / wall,
        "consumed_tokens": tokens,
        "final_reward": statistics.fmean(r["reward/mean"] for r in rows[-quarter:]),
        "first_reward": statistics.fmean(r["reward/mean"] for r in rows[:quarter]),
        "mean_staleness": statistics.fmean(r["staleness/mean"] for r in rows),
        "max_staleness_seen": max(r["staleness/max"] for r in rows),
        "mean_generation_wait_s": statistics.fmean(r["time/generation_wait_s"] for r in rows),
        "mean_weight_sync_pause_s": statistics.fmean(r["time/weight_sync_pause_s"] for r in rows),
        "response_length_mean": statistics.fmean(r["response_length/mean"] for r in rows),
        "response_length_max": max(r["response_length/max"] for r in rows),
        "total_run_s": total_run_s,
    }


def report(pairs: list[dict], config: dict) -> dict:
    """The JSON from every pair: the (lower) median pair on top, so "speedup" stays sync wall /
    async wall of the "sync" and "async" written next to it; every pair's figures below."""
    speedups = [p["speedup"] for p in pairs]
    median = next(p for p in pairs if p["speedup"] == statistics.median_low(speedups))
    return {
        "sync": median["sync"],
        "async": median["async"],
        "speedup": median["speedup"],
        "speedup_range": [min(speedups), max(speedups)],
        "pairs": [{"first": p["first"], "speedup": p["speedup"],
                   "sync_wall_s": p["sync"]["wall_s"], "async_wall_s": p["async"]["wall_s"]}
                  for p in pairs],
        "throughput_ratio": median["async"]["effective_tokens_per_s"]
        / median["sync"]["effective_tokens_per_s"],
        "reward_delta": median["async"]["final_reward"] - median["sync"]["final_reward"],
        "config": {**config, "repeats": len(pairs)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps (< 5 min on 2 cores)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--task", default=TASK, help="synthetic arithmetic options (YAML mapping)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="bench-results/async_vs_sync.json")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--warm-start-s", type=float, default=None,
                        help="seconds of supervised warm start (default 40 with --quick, else 90)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="pairs of runs, alternating which side goes first (median reported)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a run-spec override for both sides (repeatable)")
    args = parser.parse_args()
    steps = args.steps or (30 if args.quick else 100)
    work = Path(args.work_dir or f"runs/bench-async-vs-sync-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from training_core.sft import sft

    # One warm start shared by both sides, so they begin from identical weights.
    print("warm start (shared by both sides) ...", flush=True)
    base = load_spec(None, ["model.path=tiny", f"data.options={args.task}", f"seed={args.seed}"])
    seconds = args.warm_start_s or (40 if args.quick else 90)
    initial = sft(base, work / "initial_model", steps=10_000, seconds=seconds, progress=False)
    pairs = []
    for rep in range(max(1, args.repeats)):
        order = (("sync", 0), ("async", args.staleness))
        order = order if rep % 2 == 0 else order[::-1]
        results = {"first": order[0][0]}
        for name, staleness in order:
            print(f"pair {rep + 1}/{args.repeats}, {name}: max_staleness={staleness}, {steps} "
                  "steps ...", flush=True)
            results[name] = side(name, staleness, steps, initial, work / f"pair-{rep}", args.seed,
                                 args.task, args.overrides)
            print(json.dumps(results[name], indent=1), flush=True)
        results["speedup"] = results["sync"]["wall_s"] / results["async"]["wall_s"]
        print(f"pair {rep + 1}: speedup {results['speedup']:.2f}x", flush=True)
        pairs.append(results)
    out = report(pairs, {"steps": steps, "quick": args.quick, "seed": args.seed,
                         "task": args.task, "staleness": args.staleness,
                         "overrides": args.overrides, "batch_groups": 8, "group_size": 8})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    low, high = out["speedup_range"]
    print(f"speedup {out['speedup']:.2f}x, median of {len(pairs)} pairs (range {low:.2f}-"
          f"{high:.2f}; median pair: sync {out['sync']['wall_s']:.1f}s, async "
          f"{out['async']['wall_s']:.1f}s); final reward sync {out['sync']['final_reward']:.3f} "
          f"vs async {out['async']['final_reward']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
