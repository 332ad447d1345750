"""The core promise measured (issue 48): held-out accuracy against wall time for asynchronous
Oolong, synchronous Oolong and TRL's ``GRPOTrainer``, on the same model, data, reward, batch,
precision and cores.

Task, held out by construction: ``a + b`` and ``a - b`` with a, b in 0..19 (800 distinct
questions), in reasoning-gym ``chain_sum``'s wording ("State the final answer to the following
arithmetic problem: 7 - 4 ="), where SmolLM2-135M-Instruct's greedy accuracy starts near 20%
(benchmarks/learning.py's scan), so groups have reward variance. A seeded shuffle of the question
set (``SPLIT_SEED``, fixed for every system and seed) holds out 160 questions; the other 640 are
the training pool. Every question is distinct, so no held-out question can be in a trained batch
(the report checks it: ``held_out_in_train_pool``). Both parts are written as JSONL: Oolong reads
the pool as a ``jsonl:`` file source (``data.eval_size=0``: every row trains), TRL as a
``datasets.Dataset`` of the same rows in the model's chat template (conversational prompts).
Reward ``builtin:numeric``; fp32 on both sides.

Systems (benchmarks/vs_trl.py's settings, imported): ``oolong_async`` (``max_staleness=2``, one
rollout server), ``oolong_sync`` (``max_staleness=0``, two servers: generation and training take
turns, so a second server uses the trainer's idle core), ``trl`` (``torch.set_num_threads(2)`` in
one process). Each system and seed runs in a fresh process, system order rotated per seed (this
shared machine's speed drifts over minutes; rotation spreads the drift over the systems).

One evaluator: each system saves its weights at a few steps (``save_points``) with its training
wall clock at that moment, time spent saving excluded. The clock starts before the trainer is
built (Oolong's ``train()`` call: server start and model load included; TRL: before
``GRPOTrainer(...)``, model load included), so it is the wall time a user waits. Oolong's saves
come from a metrics sink that copies the pushed ``weights/v<version>/model.safetensors`` when the
step is logged (right after the push; the run's own folders are retired two versions later, so a
copy, not a link: the spare is overwritten in place); TRL's from a callback at ``on_step_end``
writing the model's state dict in the same safetensors layout (``weight_files.save``, a tied
``lm_head`` left out as Oolong's trainer does). Afterwards every saved point is scored greedily
on the 160 held-out questions by the embedded rollout engine in this process, as
``training_core/offline_eval.py``'s ``evaluate_weights`` does (same engine, prompt rendering,
reward, greedy decoding, ``CORRECT`` threshold) but keeping each question's score, which the
interval needs (``evaluate_weights`` returns only the aggregate; a check in ``--smoke`` compares
the two on one point). Each point is deleted once scored (a SmolLM2 point is 540 MB). Step 0 is
the starting model, shared by all systems (greedy decoding is deterministic), at 0 minutes.

Report: ``final`` is the mean over seeds of the last point's accuracy; ``ci95`` is a normal
interval over questions: each held-out question's correctness averaged over the seeds, then the
mean of those 160 values +- 1.96 standard errors (questions are the sampling unit; the seeds'
own spread is in ``final_per_seed``). ``target`` is the lowest of the three final means.
``minutes_to_target`` is read off the seed-mean curve (at each save point: accuracy and minutes
averaged over seeds), the first crossing linearly interpolated between save points; the
seed-mean curve ends at the final mean, so every system reaches the target by construction.
Per-seed first crossings (``None`` where a seed never got there) are reported beside it.

Aims (issue 48, 2 cores), evaluated as booleans with their numbers:
- ``async_reaches_trl_final_in_half_trl_time``: the asynchronous seed-mean curve first reaches
  TRL's final mean in at most half of TRL's total training minutes (its last save point);
- ``async_final_within_sync_ci``: the asynchronous final mean lies inside synchronous Oolong's
  ``ci95``;
- ``async_target_at_most_0_8_sync``: asynchronous minutes to target <= 0.8 x synchronous.

Modes: the full run (3 seeds x 12 steps of 8 prompts x 8 samples, save points at 3, 6, 9, 12),
``--quick`` (1 seed x 8 steps, points at 4 and 8; one seed gives no seed spread, so its interval
is over questions only), ``--smoke`` (the tiny model, no chat template, 2 steps of 2 x 2 samples,
1 seed: the machinery end to end in a test, its accuracies meaningless). The steps are set by
TRL, the slowest side: about 45 s a step at this batch on 2 idle cores if it scales from
vs_trl.py's 16-19 s at a quarter of it, which would put ``--quick`` at 10-12 minutes and the
full run near 50 (the budgets are 15 and 60). Not yet timed idle: on 2026-11-28 the machine ran
at a load average of 7-11 and TRL's first step took 464 s (Oolong's steps 25-90 s, against
5.4 s idle in learning.py), so the first ``--quick`` was cut to the two Oolong sides
(``--systems``; the aims that need TRL are then left out of ``aims``). ``--async-staleness`` sets the asynchronous side's eta
(default vs_trl.py's 2).

    python benchmarks/time_to_accuracy.py --quick --out bench-results/time_to_accuracy_quick.json

Writes the JSON and a PNG of the curves beside it (same name, ``.png``), with the machine and its
load average at the start and the end (the machine is shared: read the numbers with it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_side import grpo_config, trl_reward  # noqa: E402
from vs_trl import CORES, side_env  # noqa: E402
from vs_trl import SYSTEMS as VS_TRL_SYSTEMS  # noqa: E402

QUESTION = "State the final answer to the following arithmetic problem: {a} {op} {b} ="
OPERANDS = range(20)
HELD_OUT = 160
SPLIT_SEED = 48  # the question split, the same for every system and seed
SYSTEM_NAMES = ("oolong_async", "oolong_sync", "trl")
LABELS = {"oolong_async": "Oolong asynchronous (eta=2)", "oolong_sync": "Oolong synchronous (eta=0)",
          "trl": "TRL GRPOTrainer"}
# What every system trains with (configs/learning-chain-sum.yaml's settings).
TASK: dict[str, Any] = {"model": "smollm2", "chat_template": True, "group_size": 8,
                        "batch_groups": 8, "max_new_tokens": 32, "lr": 2e-5, "dtype": "float32",
                        "reward": "builtin:numeric"}
MODES: dict[str, dict[str, Any]] = {
    "full": {"seeds": 3, "steps": 12, "points": 4},
    "quick": {"seeds": 1, "steps": 8, "points": 2},
    "smoke": {"seeds": 1, "steps": 2, "points": 2,
              "task": {"model": "tiny", "chat_template": False, "group_size": 2,
                       "batch_groups": 2, "max_new_tokens": 4}},
}
Z95 = 1.96


# ---- the task and its held-out split -------------------------------------------------------


def questions() -> list[dict[str, str]]:
    """All 800 distinct questions with their answers."""
    return [{"question": QUESTION.format(a=a, op=op, b=b), "answer": str(a + b if op == "+" else a - b)}
            for op in "+-" for a in OPERANDS for b in OPERANDS]


def split(rows: list[dict[str, str]], held_out: int = HELD_OUT,
          seed: int = SPLIT_SEED) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(training pool, held-out set): a seeded shuffle of distinct questions, so disjoint by
    question by construction."""
    if len({r["question"] for r in rows}) != len(rows):
        raise ValueError("the question set has duplicates; a split by row would not be by question")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in order[held_out:]], [rows[i] for i in order[:held_out]]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task_for(mode: str) -> dict[str, Any]:
    return {**TASK, **MODES[mode].get("task", {})}


def save_points(steps: int, points: int) -> list[int]:
    """``points`` steps spread evenly up to the last one (always included)."""
    if points < 1 or steps < 1:
        raise ValueError("--steps and --points must be at least 1")
    return sorted({max(1, round(steps * k / points)) for k in range(1, points + 1)})


def oolong_spec(task: dict[str, Any], pool: Path, seed: int, extra: list[str] = ()):
    from training_core.config import load_spec

    return load_spec(None, [
        f"model.path={task['model']}", f"model.dtype={task['dtype']}", f"data.source=jsonl:{pool}",
        "data.eval_size=0", f"data.chat_template={str(task['chat_template']).lower()}",
        f"reward.fn={task['reward']}", "reward.executor=inline", f"seed={seed}",
        f"rollout.max_new_tokens={task['max_new_tokens']}", f"rollout.group_size={task['group_size']}",
        "rollout.max_concurrent=64", "rollout.temperature=1.0",
        f"trainer.batch_groups={task['batch_groups']}", f"trainer.lr={task['lr']}",
        "eval.every=0", "checkpoint.every=0", *extra])


# ---- the wall clock a system is measured by ------------------------------------------------


class TrainingClock:
    """Seconds since ``start``, less the time spent saving points."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.excluded = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started - self.excluded

    def save(self, step: int, write, saved: list[dict[str, Any]]) -> None:
        """Record ``step`` at the current training time, then run ``write`` off the clock."""
        seconds = self.elapsed()
        began = time.perf_counter()
        path = write()
        self.excluded += time.perf_counter() - began
        saved.append({"step": step, "seconds": seconds, "path": str(path)})


# ---- one system and seed, in its own process -----------------------------------------------


def run_oolong(system: str, task: dict[str, Any], pool: Path, seed: int, steps: int,
               points: list[int], work: Path, async_staleness: int | None = None) -> dict[str, Any]:
    from training_core.metrics import JsonlSink, MultiSink, read_metrics
    from training_core.train import train

    staleness, own = VS_TRL_SYSTEMS[system]
    if system == "oolong_async" and async_staleness is not None:
        staleness = async_staleness
    run_dir = work / "run"
    saves = work / "points"
    spec = oolong_spec(task, pool, seed, [
        f"name=tta-{system}-{seed}", f"run_dir={run_dir}", f"rollout.max_staleness={staleness}",
        f"trainer.steps={steps}", *own])
    clock, saved = TrainingClock(), []

    class SavingSink(MultiSink):
        """The run's metrics.jsonl, and a copy of the pushed weights at each save point (the
        step's line is logged right after its push: ``weights/v<version>`` is the new policy)."""

        def log(self, step: int, metrics: dict[str, float]) -> None:
            super().log(step, metrics)
            if step in points:
                source = run_dir / "weights" / f"v{int(metrics['version'])}" / "model.safetensors"
                clock.save(step, lambda: _copy_point(source, saves / f"step{step}"), saved)

    train(spec, progress=False, sink=SavingSink([JsonlSink(run_dir)]))
    total = clock.elapsed()
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) > 0 and "time/step_s" in r]
    return {"saved": saved, "train_s": total, "step_metrics": step_summary(rows),
            "trained_questions": trained_questions(run_dir, spec)}


def _copy_point(source: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, folder / "model.safetensors")
    return folder


def step_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What explains an Oolong side's speed: its step time and how much of it waited for
    generation, its staleness, its reward."""
    if not rows:
        return {}
    def med(key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None
    return {"steps": len(rows), "step_s_median": med("time/step_s"),
            "generation_wait_s_median": med("time/generation_wait_s"),
            "training_s_median": med("time/training_s"),
            "trainer_threads_borrowed_median": med("time/trainer_threads_borrowed"),
            "staleness_mean": med("staleness/mean"),
            "reward_first": rows[0].get("reward/mean"), "reward_last": rows[-1].get("reward/mean")}


def trained_questions(run_dir: Path, spec) -> list[str]:
    """The questions of every batch the run trained on (``batches.jsonl``)."""
    from training_core.data.datasets import PromptLoader, load_data

    loader = PromptLoader(load_data(spec.data, spec.seed).train, spec.seed)
    seen = set()
    for line in (run_dir / "batches.jsonl").read_text().splitlines():
        seen.update(loader.row(i)["question"] for i in json.loads(line)["prompts"])
    return sorted(seen)


def run_trl(task: dict[str, Any], pool: Path, seed: int, steps: int, points: list[int],
            work: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from training_core.data.datasets import read_jsonl
    from training_core.models.loading import load_model, load_tokenizer
    from training_core.models.paths import spec_model_dir
    from training_core.rewards.registry import resolve_reward
    from training_core.transport import weight_files

    torch.set_num_threads(CORES)
    spec = oolong_spec(task, pool, seed)  # the same model folder and reward as Oolong's
    rows = read_jsonl(pool)
    chat = task["chat_template"]  # TRL applies the chat template to conversational prompts
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["question"]}] if chat else r["question"],
         "answer": r["answer"]} for r in rows])
    trained: set[str] = set()
    reward = trl_reward(resolve_reward(spec.reward.fn, spec.reward.extract), on_prompts=lambda ps:
                        trained.update(p[-1]["content"] if isinstance(p, list) else p for p in ps))

    saves, saved = work / "points", []

    class SavePoints(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step in points:
                step = state.global_step
                clock.save(step, lambda: _save_model(model, saves / f"step{step}"), saved)

    def _save_model(model, folder: Path) -> Path:
        weights = {k: v.detach() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)  # as Oolong's trainer: the engine re-ties
        return weight_files.save(folder, weights, dtype=torch.float32)

    config = grpo_config(work, steps=steps, seed=seed, lr=task["lr"],
                         group_size=task["group_size"], batch_groups=task["batch_groups"],
                         max_new_tokens=task["max_new_tokens"], bf16=False, use_cpu=True)
    clock = TrainingClock()
    model_dir = spec_model_dir(spec)
    trainer = GRPOTrainer(model=load_model(model_dir), reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=load_tokenizer(model_dir),
                          callbacks=[SavePoints()])
    trainer.train()
    total = clock.elapsed()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"saved": saved, "train_s": total,
            "step_metrics": {"steps": len(logs),
                             "reward_first": logs[0]["reward"] if logs else None,
                             "reward_last": logs[-1]["reward"] if logs else None},
            "trained_questions": sorted(trained)}


# ---- the one evaluator ---------------------------------------------------------------------


def score_point(spec, model_dir: Path, weights_dir: Path, rows: list[dict[str, str]]) -> list[int]:
    """1/0 per held-out row: greedy, by the embedded engine in this process, prompted and scored
    as the platform's offline evaluation does (``offline_eval.score_weights``)."""
    from training_core.evaluation import CORRECT
    from training_core.offline_eval import score_weights

    return [int(s >= CORRECT) for s in score_weights(spec, model_dir, weights_dir, rows)]


# ---- the report (pure: tests build it from hand-made curves) -------------------------------


def interval(per_seed_scores: list[list[int]]) -> tuple[float, list[float]]:
    """Mean and 95% normal interval over questions: each question's score averaged over seeds."""
    per_question = [statistics.fmean(s) for s in zip(*per_seed_scores, strict=True)]
    mean = statistics.fmean(per_question)
    se = statistics.stdev(per_question) / math.sqrt(len(per_question)) if len(per_question) > 1 else 0.0
    return mean, [max(0.0, mean - Z95 * se), min(1.0, mean + Z95 * se)]


def first_crossing(curve: list[tuple[float, float]], target: float) -> float | None:
    """Minutes at which ``curve`` ((minutes, accuracy) by time) first reaches ``target``,
    linearly interpolated between the points around the crossing; None if it never does."""
    for i, (minutes, accuracy) in enumerate(curve):
        if accuracy >= target:
            if i == 0:
                return minutes
            m0, a0 = curve[i - 1]
            return m0 + (minutes - m0) * (target - a0) / (accuracy - a0)
    return None


def system_report(start_scores: list[int], seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system from its seeds; each seed: ``{"points": [{"step", "seconds", "scores"}],
    "train_s", ...}`` (points in step order, the same steps in every seed)."""
    steps = [p["step"] for p in seeds[0]["points"]]
    if any([p["step"] for p in s["points"]] != steps for s in seeds):
        raise ValueError("every seed must save the same steps")
    start = statistics.fmean(start_scores)
    curve = [{"step": 0, "minutes": 0.0, "accuracy": start, "per_seed": [start] * len(seeds)}]
    for i, step in enumerate(steps):
        accs = [statistics.fmean(s["points"][i]["scores"]) for s in seeds]
        minutes = [s["points"][i]["seconds"] / 60 for s in seeds]
        curve.append({"step": step, "minutes": statistics.fmean(minutes),
                      "accuracy": statistics.fmean(accs), "per_seed": accs,
                      "minutes_per_seed": minutes})
    final, ci = interval([s["points"][-1]["scores"] for s in seeds])
    return {"final": final, "ci95": ci, "seeds": len(seeds), "curve": curve,
            "final_per_seed": curve[-1]["per_seed"], "start": start,
            "train_minutes": statistics.fmean(s["train_s"] / 60 for s in seeds),
            "step_metrics": [s.get("step_metrics", {}) for s in seeds]}


def _seed_curve(system: dict[str, Any], k: int) -> list[tuple[float, float]]:
    return [(p.get("minutes_per_seed", [0.0] * system["seeds"])[k], p["per_seed"][k])
            for p in system["curve"]]


def build_report(systems: dict[str, dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """The issue's JSON: target = the lowest final mean; minutes to it per system (the
    seed-mean curve's first crossing, interpolated); the three aims."""
    target = min(s["final"] for s in systems.values())
    for s in systems.values():
        mean_curve = [(p["minutes"], p["accuracy"]) for p in s["curve"]]
        s["minutes_to_target"] = first_crossing(mean_curve, target)
        s["minutes_to_target_per_seed"] = [first_crossing(_seed_curve(s, k), target)
                                           for k in range(s["seeds"])]
    report: dict[str, Any] = {"systems": systems, "target": target,
                              "target_from": min(systems, key=lambda n: systems[n]["final"])}
    report["aims"] = aims(systems)
    return {**report, **extra}


def aims(systems: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each aim whose systems ran (``--systems`` may leave one out); the target is the lowest
    final mean of the systems that ran."""
    out: dict[str, dict[str, Any]] = {}
    a, s, t = (systems.get(n) for n in SYSTEM_NAMES)
    if a and t:
        trl_minutes = t["curve"][-1]["minutes"]
        reach = first_crossing([(p["minutes"], p["accuracy"]) for p in a["curve"]], t["final"])
        out["async_reaches_trl_final_in_half_trl_time"] = {
            "met": reach is not None and reach <= 0.5 * trl_minutes,
            "trl_final": t["final"], "async_minutes_to_trl_final": reach,
            "trl_minutes": trl_minutes,
            "ratio": reach / trl_minutes if reach is not None and trl_minutes else None}
    if a and s:
        ratio = (a["minutes_to_target"] / s["minutes_to_target"]
                 if a["minutes_to_target"] is not None and s["minutes_to_target"] else None)
        out["async_final_within_sync_ci"] = {
            "met": s["ci95"][0] <= a["final"] <= s["ci95"][1],
            "async_final": a["final"], "sync_ci95": s["ci95"]}
        out["async_target_at_most_0_8_sync"] = {
            "met": ratio is not None and ratio <= 0.8,
            "async_minutes": a["minutes_to_target"], "sync_minutes": s["minutes_to_target"],
            "ratio": ratio}
    return out


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, s), colour in zip(report["systems"].items(), ["C0", "C1", "C2", "C3"], strict=False):
        for k in range(s["seeds"]):
            xs, ys = zip(*_seed_curve(s, k), strict=True)
            ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=1)
        ax.plot([p["minutes"] for p in s["curve"]], [p["accuracy"] for p in s["curve"]],
                color=colour, marker="o", linewidth=2,
                label=f"{LABELS.get(name, name)}: {s['final']:.3f} "
                      f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]")
    ax.axhline(report["target"], color="grey", linestyle="--", linewidth=1,
               label=f"target {report['target']:.3f}")
    ax.set_xlabel("training wall time (minutes)")
    ax.set_ylabel(f"held-out greedy accuracy ({HELD_OUT} questions)")
    ax.set_title("Held-out accuracy against wall time (seed means; thin: each seed)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- the benchmark -------------------------------------------------------------------------


def _side(system: str, mode: str, pool: Path, seed: int, steps: int, points: list[int],
          work: Path, async_staleness: int) -> dict[str, Any]:
    """One system and seed in a fresh process (no state shared between runs)."""
    result = work / "result.json"
    subprocess.run([sys.executable, __file__, "--side", system, "--mode-name", mode,
                    "--pool", str(pool), "--seed", str(seed), "--steps", str(steps),
                    "--save-at", ",".join(map(str, points)), "--work-dir", str(work),
                    "--async-staleness", str(async_staleness), "--result", str(result)],
                   check=True, cwd=ROOT, env=side_env())
    return json.loads(result.read_text())


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
                 platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    return {"cpus": os.cpu_count(), "cpu": model, "platform": platform.platform(),
            "python": platform.python_version(), "commit": commit}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, 8 steps (<= 15 min)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 2 steps (a test)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--points", type=int, default=None, help="save points per run")
    parser.add_argument("--systems", default=",".join(SYSTEM_NAMES))
    parser.add_argument("--async-staleness", type=int, default=VS_TRL_SYSTEMS["oolong_async"][0],
                        help="eta of the asynchronous side (at least 1)")
    parser.add_argument("--out", default="bench-results/time_to_accuracy.json")
    parser.add_argument("--work-dir", default=None)
    # internal: one system and seed in its own process
    parser.add_argument("--side", choices=SYSTEM_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--mode-name", help=argparse.SUPPRESS)
    parser.add_argument("--pool", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--save-at", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    mode = args.mode_name or ("smoke" if args.smoke else "quick" if args.quick else "full")
    task = task_for(mode)
    work = Path(args.work_dir or ROOT / "runs" / f"bench-tta-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)

    if args.side:
        points = [int(p) for p in args.save_at.split(",")]
        if args.side == "trl":
            out = run_trl(task, Path(args.pool), args.seed, args.steps, points, work)
        else:
            out = run_oolong(args.side, task, Path(args.pool), args.seed, args.steps, points, work,
                             args.async_staleness)
        Path(args.result).write_text(json.dumps(out))
        return 0

    from training_core.models.paths import spec_model_dir

    load_start = os.getloadavg()
    started = time.time()
    conf = MODES[mode]
    steps, n_seeds = args.steps or conf["steps"], args.seeds or conf["seeds"]
    points = save_points(steps, args.points or conf["points"])
    if args.async_staleness < 1:
        raise SystemExit("--async-staleness must be at least 1 (0 is the synchronous side)")
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEM_NAMES):
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEM_NAMES}")
    pool_rows, held = split(questions())
    pool = write_jsonl(work / "train_pool.jsonl", pool_rows)
    write_jsonl(work / "held_out.jsonl", held)
    spec = oolong_spec(task, pool, 1)
    model_dir = spec_model_dir(spec)

    print(f"step 0 (the starting model, shared): scoring {len(held)} held-out questions ...",
          flush=True)
    start_scores = score_point(spec, model_dir, model_dir, held)
    if mode == "smoke":  # the one evaluator agrees with offline_eval's aggregate
        from training_core.offline_eval import evaluate_weights

        agg = evaluate_weights(spec, model_dir, model_dir, held)["offline_eval/accuracy"]
        if abs(agg - statistics.fmean(start_scores)) > 1e-9:
            raise SystemExit(f"score_point {statistics.fmean(start_scores)} != evaluate_weights {agg}")
    print(f"  accuracy {statistics.fmean(start_scores):.3f}", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    held_questions = {r["question"] for r in held}
    overlap: dict[str, float] = {}
    for k in range(n_seeds):
        seed = k + 1
        order = systems[k % len(systems):] + systems[: k % len(systems)]
        for system in order:
            print(f"seed {seed}: {system}, {steps} steps, saving at {points} ...", flush=True)
            side_dir = work / f"{system}-seed{seed}"
            out = _side(system, mode, pool, seed, steps, points, side_dir, args.async_staleness)
            for p in out["saved"]:
                p["scores"] = score_point(spec, model_dir, Path(p["path"]), held)
                shutil.rmtree(p["path"], ignore_errors=True)  # disk: a SmolLM2 point is 540 MB
            out["saved"].sort(key=lambda p: p["step"])
            seen = set(out.pop("trained_questions"))
            overlap[f"{system}-seed{seed}"] = len(seen & held_questions) / len(held_questions)
            runs[system].append({"points": out["saved"], "train_s": out["train_s"],
                                 "step_metrics": out["step_metrics"]})
            print(f"  {out['train_s'] / 60:.1f} min; accuracy by step: " + ", ".join(
                f"{p['step']}: {statistics.fmean(p['scores']):.3f} at {p['seconds'] / 60:.1f} min"
                for p in out["saved"]), flush=True)
            shutil.rmtree(side_dir / "run" / "weights", ignore_errors=True)

    report = build_report({s: system_report(start_scores, runs[s]) for s in systems}, {
        "held_out_in_train_pool": len(held_questions & {r["question"] for r in pool_rows}),
        "held_out_in_trained_batches": overlap,
        "task": {**task, "questions": len(pool_rows) + len(held), "held_out": len(held),
                 "train_pool": len(pool_rows), "split_seed": SPLIT_SEED,
                 "question": QUESTION, "operands": [OPERANDS.start, OPERANDS.stop - 1]},
        "config": {"mode": mode, "steps": steps, "seeds": n_seeds, "save_points": points,
                   "cores_each": CORES,
                   "oolong": {n: {"max_staleness": args.async_staleness if n == "oolong_async"
                                  else VS_TRL_SYSTEMS[n][0], "overrides": VS_TRL_SYSTEMS[n][1]}
                              for n in systems if n != "trl"},
                   "minutes_to_target": "first crossing of the seed-mean curve, interpolated",
                   "ci95": "normal, over questions (each question averaged over seeds)"},
        "machine": {**machine(), "load_avg_start": list(load_start),
                    "load_avg_end": list(os.getloadavg()),
                    "wall_minutes": (time.time() - started) / 60},
    })
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    plot(report, out_path.with_suffix(".png"))
    for name, s in report["systems"].items():
        mt = s["minutes_to_target"]
        print(f"{name}: final {s['final']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}], "
              f"target {report['target']:.3f} at "
              f"{'never' if mt is None else f'{mt:.1f} min'}", flush=True)
    for name, aim in report.get("aims", {}).items():
        print(f"aim {name}: {'met' if aim['met'] else 'NOT met'}", flush=True)
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
