"""LoRA against full fine-tuning (issue 49 item 5): SmolLM2-135M-Instruct on the chain-sum task of
benchmarks/learning.py, the same batch, steps and held-out items, side by side.

Each variant runs in a process of its own (so its peak memory is its own) through the platform's
training entry: ``full`` is the task's spec as it is, ``lora`` adds ``model.lora`` (rank 16 on
every linear projection, alpha 32) and multiplies ``trainer.lr`` by ``--lora-lr-factor`` (10:
LoRA wants about ten times full fine-tuning's learning rate, docs/lora.md).

    python benchmarks/lora.py --quick --out bench-results/lora_quick.json
    python benchmarks/lora.py --smoke --out /tmp/lora_smoke.json   # tiny model: runs, means nothing

Writes {"lora": {...}, "full": {...}, "push_bytes_ratio": r, "step_time_ratio": s,
"gain_ratio": g, "aims": {...}, "config": {...}}. Per variant: bytes pushed per update (the last
weights folder), the trainer's update time (median of time/update_s), the weight-sync time
(export + pause, medians), the trainer process's peak RSS, and the held-out greedy accuracy
before and after. Aims (2 cores): r <= 0.05, s <= 0.7, g >= 0.8.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TASK = ROOT / "configs" / "learning-chain-sum.yaml"
QUICK = {"steps": 12, "eval_size": 60}
LORA = {"rank": 16, "alpha": 32}
# --smoke: the whole benchmark on the tiny model (a character tokenizer, no chat template) in
# about a minute, to check it runs to its report; its figures mean nothing.
SMOKE = ("model.path=tiny", "data.chat_template=false", "rollout.max_new_tokens=8",
         "rollout.group_size=4", "trainer.batch_groups=2", "rollout.max_concurrent=8")
SMOKE_SIZES = {"steps": 2, "eval_size": 4}
AIMS = {"push_bytes_ratio": 0.05, "step_time_ratio": 0.7, "gain_ratio": 0.8}


def _learning():
    """benchmarks/learning.py (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("learning", ROOT / "benchmarks" / "learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variant_overrides(variant: str, lr: float, lr_factor: float,
                      smoke: bool = False) -> list[str]:
    """The spec overrides of one variant (on top of the task's spec); ``smoke``: the tiny model
    on a small batch (:data:`SMOKE`)."""
    common = list(SMOKE) if smoke else []
    if variant == "full":
        return common
    if variant == "lora":
        return [*common, f"model.lora.rank={LORA['rank']}", f"model.lora.alpha={LORA['alpha']}",
                f"trainer.lr={lr * lr_factor}"]
    raise ValueError(f"variant: {variant!r} is not full or lora")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def variant_report(task: dict[str, Any], metrics: list[dict[str, Any]], pushed_bytes: int,
                   peak_rss_mb: float) -> dict[str, Any]:
    """One variant's figures: learning.task_report's and the sync/step/memory ones."""
    rows = [r for r in metrics if r.get("step", 0) > 0]

    def median(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else 0.0

    return {**task, "pushed_bytes": pushed_bytes, "update_s_median": median("time/update_s"),
            "weight_sync_s_median": median("time/export_weights_s")
            + median("time/weight_sync_pause_s"), "peak_rss_mb": peak_rss_mb}


def build_report(full: dict[str, Any], lora: dict[str, Any], config: dict[str, Any]
                 ) -> dict[str, Any]:
    ratios = {
        "push_bytes_ratio": lora["pushed_bytes"] / full["pushed_bytes"],
        "step_time_ratio": lora["update_s_median"] / full["update_s_median"],
        # a full run that gained nothing gives no ratio to compare against
        "gain_ratio": lora["gain"] / full["gain"] if full["gain"] > 0 else None,
    }
    aims = {"push_bytes_ratio": ratios["push_bytes_ratio"] <= AIMS["push_bytes_ratio"],
            "step_time_ratio": ratios["step_time_ratio"] <= AIMS["step_time_ratio"],
            "gain_ratio": ratios["gain_ratio"] is not None
            and ratios["gain_ratio"] >= AIMS["gain_ratio"]}
    return {"lora": lora, "full": full, **ratios, "aims": aims, "aims_met": all(aims.values()),
            "config": config}


def run_variant(variant: str, work: Path, *, steps: int | None, eval_size: int | None,
                lr_factor: float, smoke: bool = False) -> dict[str, Any]:
    """Train one variant here (the child process) and report it."""
    from training_core.config import load_spec
    from training_core.metrics import read_metrics
    from training_core.train import train

    learning = _learning()
    run_dir = work / variant
    lr = load_spec(TASK).trainer.lr
    spec = learning.task_spec(TASK, run_dir, steps=steps, eval_size=eval_size,
                              extra=variant_overrides(variant, lr, lr_factor, smoke))
    result = train(spec, progress=False)
    task = learning.task_report(spec, result.first_eval, result.last_eval, read_metrics(run_dir),
                                result.wall_s, learning.seen_in_train(spec, run_dir))
    last = max((p for p in (run_dir / "weights").glob("v*") if p.is_dir()),
               key=lambda p: int(p.name[1:]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return variant_report(task, read_metrics(run_dir), folder_bytes(last), peak)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['steps']} steps and {QUICK['eval_size']} eval items")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--eval-size", type=int, default=None)
    parser.add_argument("--lora-lr-factor", type=float, default=10.0)
    parser.add_argument("--variant", choices=["full", "lora"], default=None,
                        help="run one variant in this process (what the parent starts)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"the tiny model, {SMOKE_SIZES['steps']} steps: checks the benchmark "
                             "runs to its report (its figures mean nothing)")
    parser.add_argument("--out", default="bench-results/lora.json")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    sizes = SMOKE_SIZES if args.smoke else QUICK if args.quick else {}
    steps = args.steps or sizes.get("steps")
    eval_size = args.eval_size or sizes.get("eval_size")
    work = Path(args.work_dir or ROOT / "runs" / f"bench-lora-{time.strftime('%Y%m%d-%H%M%S')}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.variant:
        report = run_variant(args.variant, work, steps=steps, eval_size=eval_size,
                             lr_factor=args.lora_lr_factor, smoke=args.smoke)
        out.write_text(json.dumps(report, indent=2))
        return 0
    variants = {}
    for variant in ("full", "lora"):
        part = out.with_name(f"{out.stem}.{variant}.json")
        cmd = [sys.executable, __file__, "--variant", variant, "--out", str(part),
               "--work-dir", str(work), "--lora-lr-factor", str(args.lora_lr_factor)]
        cmd += ["--steps", str(steps)] if steps else []
        cmd += ["--eval-size", str(eval_size)] if eval_size else []
        cmd += ["--smoke"] if args.smoke else []
        print(f"{variant}: training ...", flush=True)
        subprocess.run(cmd, check=True)
        variants[variant] = json.loads(part.read_text())
    report = build_report(variants["full"], variants["lora"], {
        "quick": args.quick, "smoke": args.smoke, "steps": steps,
        "eval_size": eval_size, "lora": LORA,
        "lora_lr_factor": args.lora_lr_factor, "task": str(TASK.relative_to(ROOT)),
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]}})
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("push_bytes_ratio", "step_time_ratio",
                                             "gain_ratio", "aims")}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
