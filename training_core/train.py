"""The asynchronous RL training loop. Read it top to bottom.

Rollout servers generate all the time (the executor's thread keeps episodes in flight within the
staleness bound); this loop only consumes. Per step:

    wait for a batch -> recompute proximal logprobs -> advantages -> update -> export weights
    -> PAUSE generation -> servers load the new weights -> bump version -> RESUME
    -> checkpoint / eval / log (generation already running again)

Generation pauses only for the weight load itself: exporting the weights happens before the pause
and checkpointing, evaluation and logging after the resume.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from tqdm import tqdm

from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import AlgorithmConfig, resolve_algorithm
from training_core.api import MetricsSink, SamplingParams, TrainBatch
from training_core.batching import build_train_batch, rows_with_gradient
from training_core.checkpoint import (
    checkpoint_dir,
    latest_checkpoint,
    prune_checkpoints,
)
from training_core.checkpoint_store import CheckpointStore
from training_core.config import RunSpec, dump_spec
from training_core.data.datasets import PromptLoader, load_data
from training_core.engines.deepspeed_trainer import (
    DeepSpeedTrainer,
    barrier,
    local_rank,
    rank_and_world,
)
from training_core.engines.rollout_client import RolloutClient
from training_core.evaluation import CORRECT, evaluate
from training_core.launch import start_embedded_fleet
from training_core.metrics import BATCH_LOG, JsonlSink, MultiSink, truncate_metrics
from training_core.models.loading import load_tokenizer, run_model_dir
from training_core.processes import Fleet
from training_core.rewards.pool import RewardPool
from training_core.rollout import Batch, RolloutExecutor
from training_core.staleness import StalenessManager, rows_needing_proximal
from training_core.weight_sync import WeightSync, make_weight_sync
from training_core.workflows import load_workflow
from training_core.workflows.base import WorkflowContext

log = logging.getLogger("oolong.train")

# Episode failures beyond this many per step are counted in rollout/episode_errors, not evented.
MAX_FAILURE_EVENTS = 5


@dataclass
class RunResult:
    run_dir: Path
    final_version: int
    last_step: int
    first_eval: dict[str, float] | None
    last_eval: dict[str, float] | None
    wall_s: float


class Timers:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.t[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.t = dict(self.t), defaultdict(float)
        return {f"time/{k}_s": v for k, v in out.items()}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_run_dir(spec: RunSpec) -> Path:
    return Path(spec.run_dir or Path("runs") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def make_sinks(spec: RunSpec, run_dir: Path) -> MetricsSink:
    sinks: list[Any] = [JsonlSink(run_dir)]
    if "http" in spec.metrics.sinks:
        from training_core.tracking_sink import HttpSink

        sinks.append(HttpSink(spec.metrics.tracker_url, spec.metrics.tracker_token,
                              spool_dir=run_dir / "spool"))
    return MultiSink(sinks)


def batch_metrics(groups, version: int, algo: AlgorithmConfig) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples]
    lengths = [s.num_output_tokens for s in samples]
    lags = [version - v for s in samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
    return {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/accuracy": sum(r >= CORRECT for r in rewards) / len(rewards),
        "response_length/mean": statistics.fmean(lengths),
        "response_length/max": max(lengths),
        "staleness/mean": statistics.fmean(lags) if lags else 0.0,
        "staleness/max": max(lags) if lags else 0.0,
        **{f"staleness/lag_{k}_frac": (sum(1 for x in lags if x == k) / len(lags) if lags else 0.0)
           for k in range(0, 5)},
        "rollout/interruptions": sum(s.info.get("interruptions", 0) for s in samples),
        "rollout/truncated_frac": sum(s.truncated for s in samples) / len(samples),
        "reward/errors": sum(1 for s in samples if s.info.get("reward_error")),
    }


def sample_records(groups, tokenizer, n: int, extract: str = "auto") -> list[dict[str, Any]]:
    """A few samples per step for the trajectory viewer: text per token and its version."""
    out = []
    for i, s in enumerate(s for g in groups[:n] for s in g.samples[:1]):
        gen = [(t, v) for t, v, m in zip(s.input_ids, s.versions, s.loss_mask, strict=True) if m]
        prompt_ids = [t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if not m]
        out.append({"index": i, "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=True),
                    "completion": s.info.get("completion", ""), "reward": s.reward,
                    "info": {"extracted": s.info.get("extracted"), "extract": extract,
                             "dropped_stale": s.dropped},
                    "tokens": [tokenizer.decode([t]) for t, _ in gen],
                    "token_versions": [v for _, v in gen]})
    return out


def proximal_and_reference(trainer: DeepSpeedTrainer, tb: TrainBatch, algo: AlgorithmConfig,
                           spec: RunSpec, version: int, compute_rows: list[int] | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """Logprobs of the policy before this update (version ``version``) and of the reference
    policy for KL presets, and how many rows took a separate trainer forward for the first.

    With one minibatch (one optimizer step per batch, the default) no separate pass is needed:
    None tells the update to use its own forward, which runs before the step (exact). With more,
    a row the current version generated has proximal = behaviour logprobs and the others are
    recomputed (``staleness.rows_needing_proximal``), among ``compute_rows`` (the rows the update
    computes; None: all). Under ZeRO-3 with several ranks a forward is a collective, so every
    rank recomputes all of its rows (the same number of forwards)."""
    ref = trainer.logprobs(tb, trainer.reference) if trainer.reference is not None else None
    mode = spec.trainer.recompute_proximal if algo.decoupled else "never"
    if mode != "never" and spec.trainer.ppo_minibatches == 1:
        return None, ref, 0
    if mode == "stale" and trainer.zero_stage == 3 and rank_and_world()[1] > 1:
        mode = "always"
    rows = rows_needing_proximal(tb.versions, tb.loss_mask, version, mode)
    if compute_rows is not None and mode != "always":
        rows = sorted(set(rows) & set(compute_rows))
    prox = tb.behav_logp.clone()
    if len(rows) == len(prox):
        prox = trainer.logprobs(tb)
    elif rows:
        sub = tb.select(rows)
        prox[torch.tensor(rows), : sub.input_ids.shape[1]] = trainer.logprobs(sub)
    return prox, ref, len(rows)


def ppo_loss(algo: AlgorithmConfig):
    return lambda *a, **k: decoupled_ppo_loss(*a, cfg=algo, **k)


@dataclass
class Resumed:
    version: int
    first_step: int
    state: dict[str, Any]  # the checkpoint's client state (loader position, pending prompts, ...)
    tag: str


def restore(trainer: DeepSpeedTrainer, run_dir: Path, sync: WeightSync) -> Resumed | None:
    """Load the latest complete checkpoint and export its weights (every rank takes part: under
    ZeRO-3 the export gathers). None when there is none."""
    found = latest_checkpoint(run_dir)
    store = CheckpointStore.from_env(run_dir)
    stored = store.latest() if store is not None else None
    if stored is not None and (found is None or stored[0] > found[0]):
        if local_rank() == 0:  # fresh nodes: one download per node
            store.download(stored[1], checkpoint_dir(run_dir))
        barrier()
        found = stored
    if not found:
        return None
    state = trainer.load_checkpoint(checkpoint_dir(run_dir), found[1])
    sync.export(trainer, state["version"])
    return Resumed(state["version"], state["step"] + 1, state, found[1])


class ThreadShare:
    """On CPU, the trainer and its local embedded servers share the machine's cores. While
    generation is held by the staleness bound (nothing in flight: with eta = 0 during every
    update, with eta > 0 whenever generation is ahead) the servers idle until the next weight
    push, so the trainer computes with their threads too.

    The other way (lending the trainer's threads to the servers while it waits for a batch, over
    an HTTP call) was measured and removed: decoding a small model is bound by per-step overhead,
    not arithmetic, and the two calls per step made synchronous steps ~22% slower (0.33-0.37 s
    against 0.26-0.28 s on the demo task, three runs each)."""

    def __init__(self, spec: RunSpec, fleet: Fleet | None, executor: RolloutExecutor, world: int):
        self.base = spec.trainer.threads
        on = (spec.trainer.borrow_idle_threads and fleet is not None and world == 1
              and not torch.cuda.is_available())
        # Never more threads than cores: several servers' threads together may exceed them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.idle_share = min(spec.rollout.server_threads * len(fleet.urls),
                              max(0, (cores or 1) - self.base)) if on else 0
        self.executor = executor
        self.borrowed = 0  # compute phases of this step that ran with the servers' threads

    def update(self) -> None:
        """Before a compute phase (the proximal pass, each micro-batch of the update): take the
        idle servers' threads, or give them back."""
        borrow = self.idle_share > 0 and self.executor.in_flight() == 0
        self.borrowed += borrow
        torch.set_num_threads(self.base + (self.idle_share if borrow else 0))

    def release(self) -> int:
        """After the update (the weight push starts generation again); the phases borrowed."""
        torch.set_num_threads(self.base)
        borrowed, self.borrowed = self.borrowed, 0
        return borrowed


class RolloutProfile:
    """The rollout side of the per-step profile, from each server's ``/server_info`` counters
    (the embedded server's; a server without them, such as SGLang, adds nothing): how busy the
    servers were, their mean decode batch and their tokens/s since the last step. Next to the
    trainer's ``time/*`` it shows which side is the bottleneck.

    Measured on a thread of its own: a server busy decoding answered slowly (~50 ms, when its
    event loop shared the GIL with the decode loop), and that wait was a fifth of an
    asynchronous step; SGLang, or a server far away, can be slow too. A step reports the newest
    finished measurement, so the numbers come one step late (the first step has none)."""

    def __init__(self, urls: list[str]):
        self.urls = list(urls)
        self.last: dict[str, tuple[float, dict[str, Any]]] = {}
        self._http = httpx.Client(timeout=2)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-profile")
        self._pending: Future | None = None

    def sample(self) -> dict[str, float]:
        """Never waits: the newest finished measurement ({} while one is still under way), and
        the next one started."""
        out: dict[str, float] = {}
        if self._pending is not None:
            if not self._pending.done():
                return out
            out = self._pending.result()
        self._pending = self._worker.submit(self._measure)
        return out

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _measure(self) -> dict[str, float]:
        busy, prefill, batch, rate = [], [], [], []
        for url in list(self.urls):
            try:
                info = self._http.get(f"{url}/server_info").json()
            except (httpx.HTTPError, ValueError):
                continue
            if not all(k in info for k in ("busy_s", "tokens_generated", "steps")):
                self.urls.remove(url)  # not an embedded server: never ask it again
                continue
            now = time.perf_counter()
            if url in self.last:
                then, before = self.last[url]
                wall = max(now - then, 1e-9)
                steps = info["steps"] - before["steps"]
                tokens = info["tokens_generated"] - before["tokens_generated"]
                busy.append(min(1.0, (info["busy_s"] - before["busy_s"]) / wall))
                if "prefill_s" in info and "prefill_s" in before:
                    prefill.append(min(1.0, (info["prefill_s"] - before["prefill_s"]) / wall))
                rate.append(tokens / wall)
                if steps > 0:
                    batch.append(tokens / steps)
            self.last[url] = (now, info)
        out = {}
        if busy:
            out["rollout/server_busy_frac"] = statistics.fmean(busy)
            out["rollout/tokens_per_s_per_server"] = statistics.fmean(rate)
        if prefill:
            out["rollout/server_prefill_frac"] = statistics.fmean(prefill)
        if batch:
            out["rollout/decode_batch_mean"] = statistics.fmean(batch)
        return out


def collective_update(trainer: DeepSpeedTrainer, tb: TrainBatch, algo: AlgorithmConfig,
                      spec: RunSpec, sync: WeightSync, version: int, timers: Timers,
                      threads: ThreadShare | None = None) -> dict[str, float]:
    """Steps 3-5 of the loop: the part every rank runs, in this order, because each call holds
    collectives (gradient all-reduce, ZeRO gathers for the export)."""
    # 3. Proximal logprobs: the policy right before this update. With one minibatch the update's
    #    own forward gives them (None here); with more, a trainer forward for the rows an older
    #    version generated (a row the current version generated has them already).
    #    Rows whose loss has no gradient (all advantages zero, no KL) are not computed at all.
    rows = rows_with_gradient(tb, kl=algo.kl_coef > 0) if spec.trainer.skip_zero_gradient_rows \
        else None
    if threads is not None:
        threads.update()
    with timers("proximal_logp"):
        prox, ref, recomputed = proximal_and_reference(trainer, tb, algo, spec, version - 1, rows)
    # 4. Policy update: decoupled PPO, token mean over the global batch.
    with timers("update"):
        stats = trainer.train_step(tb, prox, ppo_loss(algo), minibatches=spec.trainer.ppo_minibatches,
                                   ref_logp=ref, compute_rows=rows,
                                   before_micro_batch=threads.update if threads else None)
    stats["computed_rows_frac"] = stats.pop("computed_rows") / max(1, tb.input_ids.shape[0])
    stats["proximal_recomputed_frac"] = recomputed / max(1, tb.input_ids.shape[0])
    stats["threads_borrowed_phases"] = threads.release() if threads is not None else 0
    # 5. Export the new weights (generation keeps running meanwhile).
    with timers("export_weights"):
        sync.export(trainer, version)
    return stats


def checkpoint_if_due(trainer: DeepSpeedTrainer, spec: RunSpec, run_dir: Path, step: int,
                      version: int, state: Callable[[], dict[str, Any]], timers: Timers) -> Path | None:
    """A collective too: every rank saves its shard at the same steps; rank 0 prunes. ``state``
    is read only when a checkpoint is due (rank 0's reads the executor under its lock)."""
    if not (spec.checkpoint.every and step % spec.checkpoint.every == 0):
        return None
    tag = f"step{step}"
    with timers("checkpoint"):
        saved = trainer.save_checkpoint(checkpoint_dir(run_dir), tag,
                                        {"version": version, "step": step, **state()})
        if local_rank() == 0:  # every node prunes its own run directory
            prune_checkpoints(run_dir, spec.checkpoint.keep)
    store = CheckpointStore.from_env(run_dir)
    if store is not None:  # durable copy: every node its files, then rank 0 the marker
        with timers("checkpoint_upload"):
            if local_rank() == 0:  # the ranks of one node share its run directory
                store.upload(saved, tag)
            barrier()
            if rank_and_world()[0] == 0:
                store.mark_complete(tag)
                store.prune(spec.checkpoint.keep)
    return saved


def step_metrics(batch: Batch, stats: dict[str, float], *, version: int, running: int,
                 step_time: float) -> dict[str, float]:
    """The trainer's and the rollout side's numbers for one step (the batch's own numbers come
    from :func:`batch_metrics`)."""
    tokens = stats["tokens"]
    per_token = max(tokens, 1.0)
    per_computed = max(stats["computed_tokens"], 1.0)  # the skipped rows have no weights
    return {
        "loss": stats["loss"],
        "clip_frac": stats["clipped"] / per_token,
        "behav_weight/mean": stats["behav_weight_sum"] / per_computed,
        "behav_weight/max": stats["behav_weight_max"],
        "behav_weight/masked_frac": stats["behav_masked"] / per_computed,
        "kl": stats["kl_sum"] / per_token,
        "update/computed_rows_frac": stats["computed_rows_frac"],
        "grad_norm": stats["grad_norm"],
        "proximal/recomputed_frac": stats["proximal_recomputed_frac"],
        "time/trainer_threads_borrowed": stats["threads_borrowed_phases"],
        "tokens/consumed": tokens,
        "tokens_per_s": tokens / step_time,
        "rollout/queue_depth": batch.queue_depth,
        "rollout/rejected_groups": batch.rejected_groups,
        "rollout/dropped_stale_samples": batch.dropped_stale_samples,
        "rollout/episode_errors": len(batch.episode_failures),
        "rollout/running": running,
        "version": version,
        "time/step_s": step_time,
        "time/generation_wait_s": batch.wait_s,
        "time/training_s": step_time - batch.wait_s,
    }


def train(spec: RunSpec, *, resume_dir: str | Path | None = None, progress: bool = True,
          sink: MetricsSink | None = None) -> RunResult:
    wall_start = time.perf_counter()
    run_dir = Path(resume_dir) if resume_dir else default_run_dir(spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_spec(spec, run_dir / "spec.yaml")
    torch.set_num_threads(spec.trainer.threads)
    seed_everything(spec.seed)

    # ---- parts: model, data, algorithm, rollout servers, trainer --------------------------------
    model_dir = run_model_dir(spec, run_dir)
    tokenizer = load_tokenizer(model_dir)
    data = load_data(spec.data, spec.seed)
    algo = resolve_algorithm(spec.algorithm.preset, **spec.algorithm.model_dump(exclude={"preset"}))
    B = spec.trainer.batch_groups

    trainer = DeepSpeedTrainer(
        model_dir, lr=spec.trainer.lr, weight_decay=spec.trainer.weight_decay,
        grad_clip=spec.trainer.grad_clip, zero_stage=spec.trainer.zero_stage,
        dtype=spec.model.dtype, dist_backend=spec.trainer.dist_backend,
        temperature=spec.rollout.temperature, micro_batch_tokens=spec.trainer.micro_batch_tokens,
        keep_reference=algo.kl_coef > 0, share_prefixes=spec.trainer.share_prefixes)
    rank, world = rank_and_world()
    sync = make_weight_sync(spec.weight_sync, run_dir)
    if rank != 0:  # data-parallel ranks train on their shard; rank 0 owns everything else
        return follow_rank0(spec, trainer, algo, run_dir, sync, resume=bool(resume_dir))

    # ---- resume: weights, optimizer, RNG, version, step; the prompt stream below -----------------
    resumed = restore(trainer, run_dir, sync) if resume_dir else None
    version, first_step = (resumed.version, resumed.first_step) if resumed else (0, 1)

    fleet: Fleet | None = None
    if spec.rollout.server_urls:
        urls = list(spec.rollout.server_urls)
    else:
        # A resumed run samples with a fresh seed: replaying the first run's random stream would
        # repeat its samples.
        fleet = start_embedded_fleet(str(model_dir), spec.rollout.num_servers, run_dir / "logs",
                                     threads=spec.rollout.server_threads,
                                     max_batch_size=spec.rollout.max_batch_size,
                                     seed=server_seed(spec.seed, version), weight_version=0)
        urls = fleet.urls
    client = RolloutClient(urls, timeout_s=spec.rollout.request_timeout_s,
                           max_interruptions=spec.rollout.max_interruptions,
                           pause_mode=spec.rollout.interrupt_mode)
    staleness = StalenessManager(batch_groups=B, max_staleness=spec.rollout.max_staleness,
                                 max_concurrent=spec.rollout.max_concurrent)
    loader = PromptLoader(data.train, spec.seed)
    sink = sink or make_sinks(spec, run_dir)
    # Control calls (pause, weight load, resume) get their own event loop in this thread: the
    # executor's loop is busy with hundreds of in-flight requests and would delay them.
    control = asyncio.new_event_loop()
    control.run_until_complete(sync.connect(client))

    if resumed is not None:
        # Prompts in flight or buffered at the checkpoint were never trained on: hand them out
        # again first (checkpoints from before this existed carry only the position).
        state = resumed.state
        loader.restore(state["loader_position"], state.get("pending_prompts"))
        staleness.recover(version)
        dropped = truncate_metrics(run_dir, state["step"])
        control.run_until_complete(_push_weights(client, sync, version))
        sink.event("resumed", f"resumed from {resumed.tag} at version {version}",
                   step=state["step"], discarded_metric_lines=dropped,
                   requeued_prompts=len(state.get("pending_prompts", [])))
    else:
        control.run_until_complete(client.check_versions(0))
        if resume_dir:
            truncate_metrics(run_dir, 0)
            sink.event("resumed", "no complete checkpoint; starting from step 1")
    client.set_version(version)

    sampling = SamplingParams(max_new_tokens=spec.rollout.max_new_tokens,
                              temperature=spec.rollout.temperature, top_p=spec.rollout.top_p,
                              top_k=spec.rollout.top_k)
    rewards = RewardPool(spec.reward.fn, workers=spec.reward.workers,
                         timeout_s=spec.reward.timeout_s, executor=spec.reward.executor,
                         remote_backend=spec.reward.remote_backend, extract=spec.reward.extract)
    ctx = WorkflowContext(tokenizer=tokenizer, rewards=rewards, sampling=sampling,
                          group_size=spec.rollout.group_size,
                          prompt_template=spec.data.prompt_template,
                          chat_template=spec.data.chat_template, max_turns=spec.rollout.max_turns,
                          turn_discount=spec.rollout.turn_discount)
    executor = RolloutExecutor(client, load_workflow(spec.rollout.workflow, ctx), loader, staleness,
                               dynamic_filter=algo.dynamic_filter,
                               max_token_staleness=spec.rollout.token_staleness_bound)
    eval_rows = data.eval[: spec.eval.size]
    timers = Timers()
    first_eval = last_eval = None
    sink.event("started", f"run {spec.name} at version {version}", run_dir=str(run_dir))
    report = spec.metrics.report_status
    if report:
        sink.status("running")
    batch_log = (run_dir / BATCH_LOG).open("a", buffering=1)
    executor.start()
    threads = ThreadShare(spec, fleet, executor, world)
    profile = RolloutProfile(urls)
    profile.sample()  # starts the baseline measurement
    bar = tqdm(total=spec.trainer.steps, initial=first_step - 1, disable=not progress,
               desc=spec.name, unit="step", dynamic_ncols=True)
    step = first_step - 1
    try:
        if spec.eval.every and eval_rows and first_step == 1:
            first_eval = executor.run_coro(evaluate(client, ctx, eval_rows, spec.rollout.max_new_tokens))
            sink.log(0, {**first_eval, "version": 0})

        step_start = time.perf_counter()
        for step in range(first_step, spec.trainer.steps + 1):

            # 1. Take the oldest B finished groups (blocks only if generation is behind).
            with timers("wait_rollout"):
                batch = executor.prepare_batch(B, version, timeout_s=spec.rollout.batch_timeout_s)
            metrics = batch_metrics(batch.groups, version, algo)
            batch_log.write(json.dumps({"step": step, "version": version,
                                        "prompts": [g.prompt_index for g in batch.groups]}) + "\n")
            for failure in batch.episode_failures[:MAX_FAILURE_EVENTS]:
                sink.event("episode_failed", failure.message, step=step,
                           prompt_index=failure.prompt_index)

            # 2. Tensors and advantages (group-normalised outcome rewards, per preset).
            with timers("prepare"):
                tb = build_train_batch(batch.groups, pad_id=tokenizer.pad_token_id, algo=algo,
                                       max_new_tokens=spec.rollout.max_new_tokens)
                tb = scatter_batch(tb, world)  # this rank's share (all of it with one process)

            # 3-5. Proximal logprobs, update, weight export: on every rank (collective_update).
            stats = collective_update(trainer, tb, algo, spec, sync, version + 1, timers, threads)

            # 6. Pause generation only for the load: in-flight requests abort and are re-submitted
            #    with their partial output by the client once generation continues.
            with timers("weight_sync_pause"):
                control.run_until_complete(_push_weights(client, sync, version + 1))
            version += 1
            executor.kick()  # the staleness bound just moved: start more episodes

            # 7. Evaluate, log, then checkpoint: generation is already running again. The step's
            #    line is written before its checkpoint completes, so a complete checkpoint of step
            #    N always has step N's metrics (a resume drops the lines after its checkpoint and
            #    trains those steps again). Checkpoint time lands in the next step's time/*.
            if spec.eval.every and eval_rows and (step % spec.eval.every == 0
                                                  or step == spec.trainer.steps):
                with timers("eval"):
                    last_eval = executor.run_coro(
                        evaluate(client, ctx, eval_rows, spec.rollout.max_new_tokens))
                metrics.update(last_eval)

            metrics.update(step_metrics(batch, stats, version=version,
                                        running=staleness.stats().running,
                                        step_time=time.perf_counter() - step_start))
            step_start = time.perf_counter()
            metrics.update(timers.pop())
            metrics.update(profile.sample())
            sink.log(step, metrics)
            sink.trajectories(step, sample_records(batch.groups, tokenizer, n=4,
                                                   extract=spec.reward.extract))
            saved = checkpoint_if_due(trainer, spec, run_dir, step, version,
                                      executor.resume_state, timers)
            if saved is not None:
                sink.checkpoint(step, version, str(saved.resolve()))
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", v=version,
                            stale=f"{metrics['staleness/mean']:.2f}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
        sink.event("finished", f"finished at step {step}, version {version}")
        if report:
            sink.status("succeeded")
    except BaseException as exc:
        if world > 1:
            scatter_batch(None, world)  # tell the other ranks to stop
        sink.event("failed", f"{type(exc).__name__}: {exc}", step=step)
        if report:
            sink.status("failed", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        bar.close()
        batch_log.close()
        control.run_until_complete(_close_control(client, sync))
        control.close()
        executor.stop()
        profile.close()
        rewards.close()
        sink.close()
        if fleet is not None:
            fleet.stop()
    return RunResult(run_dir, version, step, first_eval, last_eval, time.perf_counter() - wall_start)


async def _push_weights(client: RolloutClient, sync: WeightSync, version: int) -> None:
    await client.pause()
    try:
        await sync.push(client, version)
    finally:
        await client.resume()


async def _close_control(client: RolloutClient, sync: WeightSync) -> None:
    try:
        await sync.close(client)
    finally:
        await client.aclose()


def server_seed(seed: int, version: int) -> int:
    """The embedded servers' sampling seed: the run's seed at the start, a different one for
    each version a run resumes at (deterministic, so a resumed run is reproducible)."""
    return seed if version == 0 else (seed * 1_000_003 + version * 7_919) % 2**31


def scatter_batch(tb: TrainBatch | None, world: int) -> TrainBatch | None:
    """Rank 0 splits the batch across ranks (interleaved, so lengths balance); every rank gets
    its share. ``None`` from rank 0 means: stop."""
    if world == 1:
        return tb
    import torch.distributed as dist

    rank = dist.get_rank()
    box: list = [None]
    if rank == 0 and tb is not None:
        n = tb.input_ids.shape[0]
        if n < world:
            raise ValueError(f"a batch of {n} samples cannot feed {world} ranks")
        box = [[tb.select(list(range(r, n, world))) for r in range(world)]]
    dist.broadcast_object_list(box, src=0)
    return None if box[0] is None else box[0][rank]


def follow_rank0(spec: RunSpec, trainer: DeepSpeedTrainer, algo: AlgorithmConfig, run_dir: Path,
                 sync: WeightSync, *, resume: bool) -> RunResult:
    """The loop of ranks other than 0: the same collective calls in the same order as rank 0
    (restore, collective_update, checkpoint_if_due), on the shard rank 0 sends."""
    start = time.perf_counter()
    _, world = rank_and_world()
    resumed = restore(trainer, run_dir, sync) if resume else None
    version, first_step = (resumed.version, resumed.first_step) if resumed else (0, 1)
    timers = Timers()  # rank 0 reports the timings
    step = first_step - 1
    for step in range(first_step, spec.trainer.steps + 1):
        tb = scatter_batch(None, world)
        if tb is None:
            break
        collective_update(trainer, tb, algo, spec, sync, version + 1, timers)
        version += 1
        checkpoint_if_due(trainer, spec, run_dir, step, version, dict, timers)
    return RunResult(run_dir, version, step, None, None, time.perf_counter() - start)
