"""`make demo`: a real asynchronous RL run on this machine's CPU with the embedded defaults.

1. builds a tiny Llama + character tokenizer locally (nothing downloaded),
2. warm-starts it briefly on the task's own generator (RL from random weights gets no reward),
3. runs asynchronous GRPO: an embedded rollout server process generates continuously while the
   DeepSpeed trainer updates and pushes weights; greedy eval accuracy is measured before and after.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from training_core.cli import _quiet_libraries

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEMO_CONFIG))
    parser.add_argument("--warm-start-seconds", type=float, default=45)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=50")
    args = parser.parse_args(argv)
    _quiet_libraries()

    from training_core.config import load_spec
    from training_core.metrics import read_metrics
    from training_core.sft import sft
    from training_core.train import train

    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    spec = load_spec(args.config, [*args.overrides, f"run_dir={run_dir}"])
    print(f"Oolong demo -> {run_dir}\n  1/2 supervised warm start ({args.warm_start_seconds:.0f} s)")
    sft(spec, run_dir / "initial_model", steps=100_000, seconds=args.warm_start_seconds)
    print(f"  2/2 asynchronous GRPO: {spec.trainer.steps} steps, max staleness "
          f"{spec.rollout.max_staleness}, {spec.rollout.num_servers} rollout server(s)")
    result = train(spec)
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    window = max(1, len(rows) // 5)
    first = statistics.fmean(r["reward/mean"] for r in rows[:window])
    last = statistics.fmean(r["reward/mean"] for r in rows[-window:])
    print("\nResult")
    if result.first_eval and result.last_eval:
        print(f"  greedy eval accuracy : {result.first_eval['eval/accuracy']:.1%} -> "
              f"{result.last_eval['eval/accuracy']:.1%}")
    print(f"  sampled reward       : {first:.3f} -> {last:.3f} (mean of first/last {window} steps)")
    print(f"  wall time            : {result.wall_s:.0f} s; metrics in {run_dir / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
