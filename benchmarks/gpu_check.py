"""The GPU check's measurement (scripts/gpu_check.sh): Oolong on one GPU against TRL's
GRPOTrainer on the same GPU, same model, data, reward, batch and steps, each in a process of its
own, one after the other.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu/gpu_check.json [--steps 10]

- ``oolong``: SmolLM2-135M-Instruct in bf16 (fp32 masters under autocast), the embedded rollout
  server on the same GPU, ``weight_sync: disk``, ``rollout.max_staleness: 1``;
- ``trl``: ``GRPOTrainer`` with ``bf16=True`` (autocast over fp32 weights), generation by
  transformers in the same process; only when ``import trl`` works (``--no-trl`` skips it).

Task: synthetic one-digit sums in SmolLM2's chat template, ``builtin:numeric``, 8 prompts x 8
samples, 64 new tokens. Per side: median step time over the steps after the first ``SKIP``,
generated tokens per second (response tokens / step time, as benchmarks/vs_trl.py counts them),
and for Oolong the weight push (export + the servers' pause, median) and the trainer's peak GPU
memory. ``ratio_step_trl_over_oolong`` above 1: Oolong's steps are shorter. Writes the card's
name, the torch/CUDA versions and every figure; nothing here has run on a GPU in this
repository's CI (docs/gpu-check.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_side import grpo_config, trl_reward, trl_step_clock  # noqa: E402

SKIP = 2  # first steps left out (CUDA context, allocator growth, the first push)
TASK = {"group_size": 8, "batch_groups": 8, "max_new_tokens": 64, "lr": 1e-6,
        "options": "{max_value: 9}"}


def _spec(run_dir: Path, steps: int, seed: int):
    from training_core.config import load_spec

    return load_spec(None, [
        "model.path=smollm2", "model.dtype=bfloat16", f"run_dir={run_dir}", f"seed={seed}",
        "weight_sync=disk", "rollout.backend=embedded", "data.source=synthetic:arithmetic",
        f"data.options={TASK['options']}", "data.chat_template=true",
        "reward.fn=builtin:numeric", "reward.executor=inline", "rollout.temperature=1.0",
        f"rollout.group_size={TASK['group_size']}", f"trainer.batch_groups={TASK['batch_groups']}",
        f"rollout.max_new_tokens={TASK['max_new_tokens']}", "rollout.max_concurrent=128",
        "rollout.max_staleness=1", f"trainer.lr={TASK['lr']}", f"trainer.steps={steps}",
        "eval.every=0", "checkpoint.every=0"])


def _median_after_skip(values: list[float]) -> float:
    return statistics.median(values[SKIP:] if len(values) > SKIP else values)


def run_oolong(steps: int, seed: int, work: Path) -> dict[str, Any]:
    import torch

    from training_core.metrics import read_metrics
    from training_core.train import train

    run_dir = work / "oolong"
    train(_spec(run_dir, steps, seed), progress=False)
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    batch = TASK["group_size"] * TASK["batch_groups"]
    step_s = [r["time/step_s"] for r in rows]
    tokens = [r["response_length/mean"] * batch for r in rows]
    steady = slice(SKIP, None) if len(rows) > SKIP else slice(None)
    push = [r.get("time/export_weights_s", 0.0) + r.get("time/weight_sync_pause_s", 0.0)
            for r in rows]
    return {"steps": len(rows), "step_s_median": _median_after_skip(step_s),
            "tokens_per_s": sum(tokens[steady]) / sum(step_s[steady]),
            "push_s_median": _median_after_skip(push),
            "export_s_median": _median_after_skip([r.get("time/export_weights_s", 0.0)
                                                   for r in rows]),
            "update_s_median": _median_after_skip([r.get("time/update_s", 0.0) for r in rows]),
            "trainer_peak_gpu_bytes": torch.cuda.max_memory_allocated(),
            "staleness_max": max(r["staleness/max"] for r in rows),
            "mismatch_kl_k3_max": max(r["mismatch/kl_k3"] for r in rows),
            "reward_curve": [round(r["reward/mean"], 4) for r in rows]}


def run_trl(steps: int, seed: int, work: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOTrainer

    from training_core.data.datasets import load_data
    from training_core.data.templates import prompt_template_text
    from training_core.models.loading import load_model, load_tokenizer
    from training_core.models.paths import resolve_model_dir
    from training_core.rewards.registry import resolve_reward

    spec = _spec(work / "unused", steps, seed)
    model_dir = resolve_model_dir("smollm2")
    template = prompt_template_text(spec.data.prompt_template)
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": template.format(**r)}], "answer": str(r["answer"])}
        for r in load_data(spec.data, seed).train])
    batch = TASK["group_size"] * TASK["batch_groups"]
    config = grpo_config(work, steps=steps, seed=seed, lr=TASK["lr"],
                         group_size=TASK["group_size"], batch_groups=TASK["batch_groups"],
                         max_new_tokens=TASK["max_new_tokens"], bf16=True, use_cpu=False)
    clock = trl_step_clock()
    reward = trl_reward(resolve_reward(spec.reward.fn, spec.reward.extract))
    trainer = GRPOTrainer(model=load_model(model_dir), reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=load_tokenizer(model_dir),
                          callbacks=[clock])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    tokens = [h["completions/mean_length"] * batch for h in logs]
    steady = slice(SKIP, None) if len(logs) > SKIP else slice(None)
    return {"steps": len(clock.step_s), "step_s_median": _median_after_skip(clock.step_s),
            "tokens_per_s": sum(tokens[steady]) / sum(clock.step_s[steady]),
            "reward_curve": [round(h["reward"], 4) for h in logs]}


def _side(side: str, steps: int, seed: int, work: Path, timeout_s: float) -> dict[str, Any]:
    result = work / f"{side}.json"
    try:
        run = subprocess.run([sys.executable, __file__, "--side", side, "--steps", str(steps),
                              "--seed", str(seed), "--work-dir", str(work), "--result",
                              str(result)], cwd=ROOT, timeout=timeout_s, capture_output=True,
                             text=True)
    except subprocess.TimeoutExpired as exc:  # the report still says what finished
        return {"error": f"no result within {timeout_s:.0f} s: {str(exc.stderr)[-2000:]}"}
    if run.returncode != 0:
        return {"error": f"exit {run.returncode}: {run.stderr[-3000:]}"}
    return json.loads(result.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu/gpu_check.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--side-timeout", type=float, default=240.0)
    parser.add_argument("--side", choices=["oolong", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        run = run_oolong if args.side == "oolong" else run_trl
        Path(args.result).write_text(json.dumps(run(args.steps, args.seed, Path(args.work_dir))))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: the GPU check measures nothing on CPU", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "task": TASK, "steps": args.steps, "skip": SKIP}
    try:
        import trl

        report["trl"] = trl.__version__
    except ImportError:
        report["trl"] = None
    with tempfile.TemporaryDirectory(prefix="oolong-gpu-check-") as tmp:
        report["oolong"] = _side("oolong", args.steps, args.seed, Path(tmp), args.side_timeout)
        if report["trl"] and not args.no_trl:
            report["trl_grpo"] = _side("trl", args.steps, args.seed, Path(tmp), args.side_timeout)
    ours, theirs = report["oolong"], report.get("trl_grpo") or {}
    if "step_s_median" in ours and "step_s_median" in theirs:
        report["ratio_step_trl_over_oolong"] = theirs["step_s_median"] / ours["step_s_median"]
        report["ratio_tokens_per_s_oolong_over_trl"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "task"}, indent=2))
    return 0 if "error" not in ours else 1


if __name__ == "__main__":
    sys.exit(main())
