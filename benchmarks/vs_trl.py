"""Oolong against TRL's GRPOTrainer, side by side: same model folder, data, reward, seed, batch
and machine, in one run.

Three systems per workload, each in its own process, one after the other, all from the same
warm-started weights:
- ``trl``: TRL's ``GRPOTrainer`` (synchronous, one process), torch with 2 threads;
- ``oolong_sync``: Oolong with ``rollout.max_staleness=0`` (synchronous RL), two rollout servers;
- ``oolong_async``: Oolong with ``rollout.max_staleness=2``, one rollout server.
Equal cores: this machine's 2. TRL gets both as torch threads in its one process. Oolong runs
one thread per process (the embedded rollout servers and the trainer) and the trainer borrows
the idle servers' threads, never more than the cores (README "How the asynchronous loop
works"). Synchronous Oolong runs two servers because generation and training take turns there:
during generation the trainer's core would idle, and a second decode thread in one server buys
little for a small model (its decode step is mostly per-step overhead), while a second server
halves each one's batch (generation wait 0.082-0.095 s -> 0.065-0.076 s per demo step, three
back-to-back pairs). Asynchronously the trainer computes all the time, so one server.

Workloads: ``demo`` (configs/demo.yaml's task: two-number sums, 8 prompts x 16 samples, 12 new
tokens), ``long_tail`` (async_vs_sync.py's task: running sums of 2-8 terms with a long tail of
long answers, 8 prompts x 8 samples, 48 new tokens), and the real model, ``smollm2_fp32`` and
``smollm2_bf16`` (``--workloads smollm2`` runs both): SmolLM2-135M-Instruct from the same
converted folder for all three systems, reasoning-gym ``chain_sum`` one-digit sums in the chat
template with ``builtin:numeric`` (greedy accuracy about 20% at the start, so rewards vary inside
groups), 4 prompts x 4 samples, 32 new tokens; both sides fp32, then both bf16 (TRL's
``bf16=True``, Oolong's ``model.dtype=bfloat16``), reported as separate workloads.

Per system: wall time per step (median of the steps after the first few), generated tokens per
second, and the reward curve. Ratios above 1 mean Oolong is faster per step.

Rounds (``--repeats``, default 3, 1 with ``--quick``): the three systems run one after the
other, each round in a rotated order, and every ratio is taken inside one round. This machine's
speed drifts by up to 1.5x within minutes (TRL's median step went 0.164 s -> 0.374 s between two
runs of the same code), so one round can say 1.5x or 2.4x; the round whose async/TRL ratio is
the median stands for the workload, and every round's ratios and their range come with it.

    python benchmarks/vs_trl.py --quick --out bench-results/vs_trl.json

TRL is a benchmark dependency only: ``pip install -c constraints.txt '.[bench]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

from trl_side import grpo_config, trl_reward, trl_step_clock  # noqa: E402

CORES = 2  # what each system gets in total (this machine's cores)
SKIP = 3  # first steps left out of the median (allocations, caches, the first weight push)
WORKLOADS: dict[str, dict[str, Any]] = {
    "demo": {"options": "{min_terms: 2, max_terms: 2, max_value: 30}", "group_size": 16,
             "batch_groups": 8, "max_new_tokens": 12, "lr": 2e-4},
    "long_tail": {"options": "{min_terms: 2, max_terms: 8, max_value: 9, long_tail: 0.15}",
                  "group_size": 8, "batch_groups": 8, "max_new_tokens": 48, "lr": 1e-4},
}
# The real model (issue 26): SmolLM2-135M-Instruct, no warm start, one-digit sums and
# differences from reasoning-gym in the model's chat template, where its greedy accuracy is about
# 20% (benchmarks/learning.py's scan), so groups have reward variance. One workload per
# precision, both sides at it: TRL's bf16=True (autocast over fp32 weights) against Oolong's
# model.dtype=bfloat16.
SMOLLM2 = {"model": "smollm2", "source": "reasoning_gym:chain_sum",
           "options": "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
           "chat_template": True, "reward": "builtin:numeric", "group_size": 4,
           "batch_groups": 4, "max_new_tokens": 32, "lr": 1e-5, "steps": 20, "quick_steps": 8}
WORKLOADS.update({"smollm2_fp32": {**SMOLLM2, "dtype": "float32"},
                  "smollm2_bf16": {**SMOLLM2, "dtype": "bfloat16"}})
ALIASES = {"smollm2": ["smollm2_fp32", "smollm2_bf16"]}  # --workloads smollm2 means both
# system -> (max_staleness, its own run-spec overrides); TRL's settings are in run_trl
SYSTEMS: dict[str, tuple[int, list[str]] | None] = {
    "trl": None, "oolong_sync": (0, ["rollout.num_servers=2"]), "oolong_async": (2, [])}
# ratio -> (the system it divides by, the system whose step time it divides)
RATIOS = {"async_vs_trl": ("trl", "oolong_async"), "sync_vs_trl": ("trl", "oolong_sync"),
          "async_vs_sync": ("oolong_sync", "oolong_async")}


def _spec(workload: str, seed: int, extra: list[str] = ()):
    from training_core.config import load_spec

    w = WORKLOADS[workload]
    return load_spec(None, [f"model.path={w.get('model', 'tiny')}",
                            f"data.source={w.get('source', 'synthetic:arithmetic')}",
                            f"data.options={w['options']}", f"seed={seed}",
                            f"data.chat_template={str(w.get('chat_template', False)).lower()}",
                            f"reward.fn={w.get('reward', 'builtin:arithmetic')}",
                            f"model.dtype={w.get('dtype', 'float32')}", *extra])


def _summary(step_s: list[float], tokens: list[float], rewards: list[float]) -> dict[str, Any]:
    steady = step_s[SKIP:] if len(step_s) > SKIP else step_s
    tok = tokens[SKIP:] if len(tokens) > SKIP else tokens
    median = statistics.median(steady)
    quarter = max(1, len(rewards) // 4)
    return {"steps": len(step_s), "step_s_median": median,
            "tokens_per_s": sum(tok) / sum(steady),
            "reward_first": statistics.fmean(rewards[:quarter]),
            "reward_last": statistics.fmean(rewards[-quarter:]),
            "reward_curve": [round(r, 4) for r in rewards]}


def round_ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each ratio of one round: above 1 means the second system's steps are shorter."""
    return {name: results[slow]["step_s_median"] / results[fast]["step_s_median"]
            for name, (slow, fast) in RATIOS.items()}


def combine_rounds(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One workload's report from its rounds: the systems' results and ratios of the round whose
    async/TRL ratio is the median (the lower middle one for an even count), so every reported
    ratio was measured inside one round; plus each round's step times and ratios, and each
    ratio's range over the rounds."""
    per_round = [round_ratios(r) for r in rounds]
    key = [p["async_vs_trl"] for p in per_round]
    middle = key.index(statistics.median_low(key))
    return {**rounds[middle], **per_round[middle], "median_round": middle,
            "rounds": [{**ratios, **{system: r[system]["step_s_median"] for system in SYSTEMS}}
                       for ratios, r in zip(per_round, rounds, strict=True)],
            "ranges": {name: [min(p[name] for p in per_round), max(p[name] for p in per_round)]
                       for name in RATIOS}}


# ---- one system, in its own process --------------------------------------------------------


def run_trl(workload: str, model: Path, steps: int, seed: int, work: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    from training_core.data.datasets import load_data
    from training_core.data.templates import prompt_template_text
    from training_core.models.loading import load_model, load_tokenizer
    from training_core.rewards.registry import resolve_reward

    torch.set_num_threads(CORES)
    w = WORKLOADS[workload]
    spec = _spec(workload, seed)
    template = prompt_template_text(spec.data.prompt_template)
    rows = load_data(spec.data, seed).train
    chat = spec.data.chat_template  # TRL applies the chat template to conversational prompts
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": template.format(**r)}] if chat
         else template.format(**r), "answer": str(r["answer"])} for r in rows])
    batch = w["group_size"] * w["batch_groups"]
    config = grpo_config(work, steps=steps, seed=seed, lr=w["lr"], group_size=w["group_size"],
                         batch_groups=w["batch_groups"], max_new_tokens=w["max_new_tokens"],
                         bf16=spec.model.dtype == "bfloat16", use_cpu=True)
    clock = trl_step_clock()
    reward = trl_reward(resolve_reward(spec.reward.fn, spec.reward.extract))
    trainer = GRPOTrainer(model=load_model(model), reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=load_tokenizer(model),
                          callbacks=[clock])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    tokens = [h["completions/mean_length"] * batch for h in logs]
    return {**_summary(clock.step_s, tokens, [h["reward"] for h in logs]),
            "precision": "bf16 autocast over fp32 weights" if config.bf16 else "fp32",
            "threads": f"torch.set_num_threads({CORES}) in one process"}


def run_oolong(workload: str, staleness: int, model: Path, steps: int, seed: int,
               work: Path, overrides: list[str] = ()) -> dict[str, Any]:
    from training_core.metrics import read_metrics
    from training_core.train import train

    w = WORKLOADS[workload]
    run_dir = work / f"oolong-{staleness}"
    run_dir.mkdir(parents=True, exist_ok=True)
    link = run_dir / "initial_model"
    if not link.exists():
        link.symlink_to(model.resolve())
    spec = _spec(workload, seed, [
        f"name=vs-trl-{workload}-{staleness}", f"run_dir={run_dir}",
        f"rollout.max_new_tokens={w['max_new_tokens']}", f"rollout.group_size={w['group_size']}",
        "rollout.max_concurrent=64", "rollout.temperature=1.0", "reward.executor=inline",
        f"rollout.max_staleness={staleness}", f"trainer.batch_groups={w['batch_groups']}",
        f"trainer.lr={w['lr']}", f"trainer.steps={steps}", "eval.every=0", "checkpoint.every=0",
        *overrides])
    train(spec, progress=False)
    return oolong_result([r for r in read_metrics(run_dir) if r["step"] > 0], workload,
                         staleness, spec.rollout.num_servers, spec.model.dtype)


def oolong_result(rows: list[dict[str, Any]], workload: str, staleness: int, num_servers: int,
                  dtype: str) -> dict[str, Any]:
    """One Oolong side's figures from its metric rows (steps > 0): tokens are the batch's
    response tokens, as TRL's side counts them."""
    w = WORKLOADS[workload]
    batch = w["group_size"] * w["batch_groups"]
    return {**_summary([r["time/step_s"] for r in rows],
                       [r["response_length/mean"] * batch for r in rows],
                       [r["reward/mean"] for r in rows]),
            "max_staleness": staleness, "num_servers": num_servers, "precision": dtype,
            "threads": (f"{num_servers} rollout servers (each an HTTP front end "
                        "and an engine process decoding on 1 thread) and the trainer (1 thread); "
                        f"the trainer borrows idle servers' threads up to {CORES}")}


# ---- the benchmark -------------------------------------------------------------------------


# A parent that has joined a process group (a test that trained in process, torchrun) leaves
# these in its environment; a side inheriting them would take itself for one rank of a world
# (accelerate, under TRL, then waits for MASTER_ADDR). Each side starts as a world of its own.
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")


def side_env() -> dict[str, str]:
    """This process's environment without a process group's variables (DISTRIBUTED_ENV)."""
    return {k: v for k, v in os.environ.items()
            if k not in DISTRIBUTED_ENV and not k.startswith("TORCHELASTIC_")}


def _side(system: str, workload: str, model: Path, steps: int, seed: int, work: Path,
          overrides: list[str]) -> dict:
    """One system in a fresh process (no state shared between systems)."""
    result = work / f"{system}.json"
    argv = [sys.executable, __file__, "--side", system, "--workload", workload, "--model",
            str(model), "--steps", str(steps), "--seed", str(seed), "--work-dir", str(work),
            "--result", str(result), *[f"--oolong-set={o}" for o in overrides]]
    subprocess.run(argv, check=True, cwd=ROOT, env=side_env())
    return json.loads(result.read_text())


def warm_start(workload: str, seed: int, seconds: float, work: Path) -> Path:
    """The tiny model's supervised warm start (RL from random weights gets no reward); a real
    model starts from its own weights."""
    from transformers.utils import logging as hf_logging

    from training_core.models.paths import spec_model_dir
    from training_core.sft import sft

    if WORKLOADS[workload].get("model", "tiny") != "tiny":
        return spec_model_dir(_spec(workload, seed))

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return sft(_spec(workload, seed), work / "initial_model", steps=10_000, seconds=seconds,
               progress=False)


def workload_steps(workload: str, steps: int | None, quick: bool) -> int:
    """Steps per system: ``--steps``, else the workload's own (a real model's step takes
    seconds, not a tenth of one), else 12 with --quick and 40 without."""
    w = WORKLOADS[workload]
    return steps or (w.get("quick_steps", 12) if quick else w.get("steps", 40))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps (< 5 min on 2 cores)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds of the three systems per workload (default 3; 1 with --quick)")
    parser.add_argument("--warm-start-s", type=float, default=None)
    parser.add_argument("--workloads", default="demo,long_tail,smollm2",
                        help="comma-separated; smollm2 means smollm2_fp32,smollm2_bf16")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench-results/vs_trl.json")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--oolong-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a run-spec override for both Oolong sides (repeatable)")
    # internal: one system in its own process
    parser.add_argument("--side", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work_dir or ROOT / "runs" / f"bench-vs-trl-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)

    if args.side:
        steps = args.steps
        if args.side == "trl":
            out = run_trl(args.workload, Path(args.model), steps, args.seed, work)
        else:
            staleness, own = SYSTEMS[args.side]
            out = run_oolong(args.workload, staleness, Path(args.model), steps, args.seed, work,
                             [*own, *args.oolong_set])
        Path(args.result).write_text(json.dumps(out))
        return 0

    seconds = args.warm_start_s or (25 if args.quick else 60)
    repeats = args.repeats or (1 if args.quick else 3)
    report: dict[str, Any] = {"workloads": {}}
    workloads = [w for name in args.workloads.split(",") for w in ALIASES.get(name, [name])]
    for workload in workloads:
        wdir = work / workload
        steps = workload_steps(workload, args.steps, args.quick)
        if WORKLOADS[workload].get("model", "tiny") == "tiny":
            print(f"{workload}: warm start ({seconds:.0f} s, shared by all three) ...", flush=True)
        model = warm_start(workload, args.seed, seconds, wdir)
        rounds = []
        for r in range(repeats):
            order = list(SYSTEMS)[r % len(SYSTEMS):] + list(SYSTEMS)[: r % len(SYSTEMS)]
            results: dict[str, Any] = {}
            for system in order:
                print(f"{workload}: round {r + 1}/{repeats}, {system}, {steps} steps ...",
                      flush=True)
                results[system] = _side(system, workload, model, steps, args.seed,
                                        wdir / f"round-{r + 1}", args.oolong_set)
                print(f"  {results[system]['step_s_median']:.3f} s/step, "
                      f"{results[system]['tokens_per_s']:.0f} tok/s, reward "
                      f"{results[system]['reward_first']:.3f} -> "
                      f"{results[system]['reward_last']:.3f}", flush=True)
            rounds.append(results)
        combined = combine_rounds(rounds)
        report["workloads"][workload] = combined
        print(f"{workload}: " + ", ".join(
            f"{name.replace('_vs_', '/').replace('trl', 'TRL')} {combined[name]:.2f}x "
            f"[{combined['ranges'][name][0]:.2f}-{combined['ranges'][name][1]:.2f}]"
            for name in RATIOS), flush=True)
    report["config"] = {"steps": {w: workload_steps(w, args.steps, args.quick) for w in workloads},
                        "quick": args.quick, "seed": args.seed,
                        "repeats": repeats,
                        "oolong_overrides": args.oolong_set,
                        "skip_first_steps": SKIP, "cores_each": CORES, "workloads": WORKLOADS}
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                         "python": platform.python_version()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
