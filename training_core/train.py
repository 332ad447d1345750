"""The asynchronous RL training loop. Read it top to bottom.

Rollout servers generate all the time (the executor's thread keeps episodes in flight within the
staleness bound); this loop only consumes. Per step:

    wait for a batch -> advantages -> recompute proximal logprobs -> update -> export weights
    -> PAUSE generation -> servers load the new weights -> advance the version -> RESUME
    -> evaluate / log / checkpoint (generation already running again)

Generation pauses only for the weight load itself: exporting the weights happens before the pause
and checkpointing, evaluation and logging after the resume. The parts the loop uses are wired in
run_setup.py; what a step reports is named in step_metrics.py.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from training_core import metric_names
from training_core.algorithms.correction import (
    MISMATCH_MAX_KEYS,
    MISMATCH_SUM_KEYS,
    CorrectionConfig,
    add_sums,
    mismatch_metrics,
)
from training_core.algorithms.loss import decoupled_ppo_loss, resolve_correction
from training_core.algorithms.presets import AlgorithmConfig
from training_core.api import MetricsSink, NonFiniteUpdate, TrainBatch, TrainEngine
from training_core.batching import build_train_batch, rows_with_gradient
from training_core.checkpoint import checkpoint_dir, prune_checkpoints
from training_core.checkpoint_store import CheckpointStore
from training_core.config import RunSpec
from training_core.disk_full import failure_reason
from training_core.evaluation import evaluate
from training_core.metrics import BATCH_LOG
from training_core.proximal import proximal_rows
from training_core.reward_failures import RewardFailureWatch
from training_core.run_setup import Run, build_run
from training_core.step_metrics import (
    advantage_metrics,
    batch_metrics,
    sample_records,
    step_metrics,
)
from training_core.thread_share import ThreadShare
from training_core.transport.weight_sync import WeightSync, push_weights
from training_core.update_guard import UpdateRefusals
from training_core.world import (
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    local_rank,
    rank_and_world,
)

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


def train(spec: RunSpec, *, resume_dir: str | Path | None = None, progress: bool = True,
          sink: MetricsSink | None = None) -> RunResult:
    wall_start = time.perf_counter()
    run = build_run(spec, resume_dir=resume_dir, sink=sink)
    if run.rank != 0:  # data-parallel ranks follow rank 0's collective calls on their shard
        return follow_rank0(run)
    algo, trainer, sync, client, executor = run.algo, run.trainer, run.sync, run.client, run.executor
    sink, policy, B = run.sink, run.policy, spec.trainer.batch_groups
    timers, reward_watch = Timers(), RewardFailureWatch(spec.reward.max_failing_steps)
    refusals = UpdateRefusals(spec, sink)
    first_eval = last_eval = None
    sink.event("started", f"run {spec.name} at version {policy.current}", run_dir=str(run.run_dir))
    if spec.metrics.report_status:
        sink.status("running")
    batch_log = (run.run_dir / BATCH_LOG).open("a", buffering=1)
    executor.start()
    run.profile.sample()  # starts the baseline measurement
    bar = tqdm(total=spec.trainer.steps, initial=run.first_step - 1, disable=not progress,
               desc=spec.name, unit="step", dynamic_ncols=True)
    step = run.first_step - 1
    try:
        if spec.eval.every and run.eval_rows and run.first_step == 1:
            first_eval = run_eval(run, step=0)
            sink.log(0, {**first_eval, "version": 0})

        step_start = time.perf_counter()
        for step in range(run.first_step, spec.trainer.steps + 1):

            # 1. Take the oldest B finished groups (blocks only if generation is behind).
            with timers("wait_rollout"):
                batch = executor.prepare_batch(B, policy.current,
                                               timeout_s=spec.rollout.batch_timeout_s)
            if refusals.rewards_refused(batch.groups, step, run.world):  # [issue 47] no NaN
                continue  # in (raises when it repeats): see training_core/update_guard.py
            metrics = batch_metrics(batch.groups, policy.current, algo)
            batch_log.write(json.dumps({"step": step, "version": policy.current,
                                        "prompts": [g.prompt_index for g in batch.groups]}) + "\n")
            for failure in batch.episode_failures[:MAX_FAILURE_EVENTS]:
                sink.event("episode_failed", failure.message, step=step,
                           prompt_index=failure.prompt_index)
            # Failed rewards score 0: the first error of each kind is evented, and the run fails
            # when most rewards keep failing (it would only look like a hard task).
            _, new_kinds = reward_watch.observe(
                [s.info.get("reward_error") for g in batch.groups for s in g.samples])
            for kind, message in new_kinds:
                sink.event("reward_error", message[:2000], step=step, error_kind=kind)
            reward_watch.check()

            # 2. Tensors and advantages (group-normalised outcome rewards, per preset).
            with timers("prepare"):
                tb = build_train_batch(batch.groups, pad_id=run.tokenizer.pad_token_id, algo=algo,
                                       max_new_tokens=spec.rollout.max_new_tokens)
                metrics.update(advantage_metrics(tb))
                tb = scatter_batch(tb, run.world)  # this rank's share (all of it with one process)

            # 3-5. Proximal logprobs, update, weight export: on every rank (collective_update).
            try:
                stats = collective_update(trainer, tb, algo, spec, sync, policy.current + 1,
                                          timers, run.threads)
            except NonFiniteUpdate as exc:  # [issue 47] refused before the step: nothing pushed
                refusals.refused(exc, batch.groups, step)  # raises when it repeats
                continue
            refusals.accepted()

            # 6. Pause generation only for the load, then advance the version: in-flight requests
            #    abort and are re-submitted with their partial output once generation continues.
            with timers("weight_sync_pause"):
                run.control.run_until_complete(push_weights(client, sync, policy))
            executor.kick()  # the staleness bound just moved: start more episodes

            # 7. Evaluate, log, then checkpoint: generation is already running again. The step's
            #    line is written before its checkpoint completes, so a complete checkpoint of step
            #    N always has step N's metrics (a resume drops the lines after its checkpoint and
            #    trains those steps again). Checkpoint time lands in the next step's time/*.
            if spec.eval.every and run.eval_rows and (step % spec.eval.every == 0
                                                      or step == spec.trainer.steps):
                with timers("eval"):
                    last_eval = run_eval(run, step)
                metrics.update(last_eval)
            metrics.update(step_metrics(batch, stats, version=policy.current,
                                        running=run.staleness.stats().running,
                                        step_time=time.perf_counter() - step_start))
            step_start = time.perf_counter()
            metrics.update(timers.pop())
            metrics.update(run.profile.sample())
            sink.log(step, metrics)
            sink.trajectories(step, sample_records(batch.groups, run.tokenizer, n=4,
                                                   extract=spec.reward.extract))
            saved = checkpoint_if_due(trainer, spec, run.run_dir, step, policy.current,
                                      lambda: {**executor.resume_state(),
                                               "undelivered": sink.undelivered()}, timers)
            if saved is not None:
                sink.checkpoint(step, policy.current, str(saved.resolve()))
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", v=policy.current,
                            stale=f"{metrics['staleness/mean']:.2f}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
        sink.event("finished", f"finished at step {step}, version {policy.current}")
        if spec.metrics.report_status:
            sink.status("succeeded")
    except BaseException as exc:
        if run.world > 1:
            scatter_batch(None, run.world)  # tell the other ranks to stop
        reason = failure_reason(exc, run.run_dir)  # [issue 47] a full disk is named as such
        # Each report on its own: a sink that cannot write (a full disk) must neither keep the
        # status from going out nor replace the run's own error.
        with suppress(Exception):
            sink.event("failed", reason, step=step)
        if spec.metrics.report_status:
            with suppress(Exception):
                sink.status("failed", reason)
        raise
    finally:
        bar.close()
        batch_log.close()
        run.close()
    return RunResult(run.run_dir, policy.current, step, first_eval, last_eval,
                     time.perf_counter() - wall_start)


def follow_rank0(run: Run) -> RunResult:
    """The loop of ranks other than 0: the same collective calls in the same order as rank 0
    (restore in build_run, collective_update, checkpoint_if_due), on the shard rank 0 sends."""
    start = time.perf_counter()
    timers = Timers()  # rank 0 reports the timings
    step = run.first_step - 1
    for step in range(run.first_step, run.spec.trainer.steps + 1):
        tb = scatter_batch(None, run.world)
        if tb is None:
            break
        try:
            collective_update(run.trainer, tb, run.algo, run.spec, run.sync,
                              run.policy.current + 1, timers)
        except NonFiniteUpdate:  # [issue 47] every rank refused it; rank 0 decides what follows
            continue
        run.policy.advance()  # this rank's count: it numbers its exports and checkpoints
        checkpoint_if_due(run.trainer, run.spec, run.run_dir, step, run.policy.current, dict,
                          timers)
    return RunResult(run.run_dir, run.policy.current, step, None, None, time.perf_counter() - start)


# ---- the steps' parts ----------------------------------------------------------------------------

def collective_update(trainer: TrainEngine, tb: TrainBatch, algo: AlgorithmConfig,
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
    # 4. Policy update: decoupled PPO with the rollout correction, token mean over the global
    #    batch; the behaviour-proximal mismatch is measured on the way.
    sums: dict[str, float] = {}
    correction = resolve_correction(spec.algorithm.rollout_correction, algo)
    with timers("update"):
        stats = trainer.train_step(tb, prox, ppo_loss(algo, correction, sums),
                                   minibatches=spec.trainer.ppo_minibatches,
                                   ref_logp=ref, compute_rows=rows,
                                   before_micro_batch=threads.update if threads else None)
    stats.update(mismatch_metrics(reduce_mismatch(sums, rank_and_world()[1])))
    stats["computed_rows_frac"] = stats.pop("computed_rows") / max(1, tb.input_ids.shape[0])
    stats["proximal_recomputed_frac"] = recomputed / max(1, tb.input_ids.shape[0])
    stats["threads_borrowed_phases"] = threads.release() if threads is not None else 0
    # 5. Export the new weights (generation keeps running meanwhile).
    with timers("export_weights"):
        sync.export(trainer, version)
    return stats


def proximal_and_reference(trainer: TrainEngine, tb: TrainBatch, algo: AlgorithmConfig,
                           spec: RunSpec, version: int, compute_rows: list[int] | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """Logprobs of the policy before this update (version ``version``) and of the reference
    policy for KL presets, and how many rows took a separate trainer forward for the first.

    Which rows take that forward is ``proximal.proximal_rows`` (the one rule; None: the update's
    own forward gives them, exactly); the others keep their behaviour logprobs."""
    ref = trainer.logprobs(tb, trainer.reference) if trainer.reference is not None else None
    rows = proximal_rows(mode=spec.recompute_proximal_mode, decoupled=algo.decoupled,
                         minibatches=spec.trainer.ppo_minibatches, versions=tb.versions,
                         loss_mask=tb.loss_mask, version=version, compute_rows=compute_rows,
                         collective_forward=trainer.zero_stage == 3 and rank_and_world()[1] > 1)
    if rows is None:
        return None, ref, 0
    prox = tb.behav_logp.clone()
    if len(rows) == len(prox):
        prox = trainer.logprobs(tb)
    elif rows:
        sub = tb.select(rows)
        prox[torch.tensor(rows), : sub.input_ids.shape[1]] = trainer.logprobs(sub)
    return prox, ref, len(rows)


def ppo_loss(algo: AlgorithmConfig, correction: CorrectionConfig, sums: dict[str, float]):
    """The update's loss; each micro-batch's mismatch statistics are folded into ``sums``."""
    def loss(*a, **k):
        value, stats = decoupled_ppo_loss(*a, cfg=algo, correction=correction, **k)
        add_sums(sums, stats.mismatch)
        return value, stats
    return loss


def reduce_mismatch(sums: dict[str, float], world: int) -> dict[str, float]:
    """The global batch's mismatch statistics: sums added, maxima taken over the ranks (a
    collective: every rank calls it once per step)."""
    if world == 1:
        return sums
    added = all_reduce_sum([sums.get(k, 0.0) for k in MISMATCH_SUM_KEYS])
    top = all_reduce_max([sums.get(k, 0.0) for k in MISMATCH_MAX_KEYS])
    return {**dict(zip(MISMATCH_SUM_KEYS, added, strict=True)),
            **dict(zip(MISMATCH_MAX_KEYS, top, strict=True))}


def run_eval(run: Run, step: int) -> dict[str, float]:
    """Greedy evaluation beside training; rows that failed are counted (eval/errors) and the
    first failure is evented."""
    errors: list[str] = []
    rows = run.eval_rows or []
    out = run.executor.run_coro(evaluate(run.client, run.ctx, rows,
                                         run.spec.rollout.max_new_tokens, errors))
    if errors:
        run.sink.event("eval_errors", f"{len(errors)} of {len(rows)} eval rows failed (scored 0); "
                       f"first: {errors[0][:2000]}", step=step)
    return out


def checkpoint_if_due(trainer: TrainEngine, spec: RunSpec, run_dir: Path, step: int,
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


def scatter_batch(tb: TrainBatch | None, world: int) -> TrainBatch | None:
    """Rank 0 splits the batch across ranks (interleaved, so lengths balance); every rank gets
    its share. ``None`` from rank 0 means: stop."""
    if world == 1:
        return tb
    rank = rank_and_world()[0]
    shares = None
    if rank == 0 and tb is not None:
        n = tb.input_ids.shape[0]
        if n < world:
            raise ValueError(f"a batch of {n} samples cannot feed {world} ranks")
        shares = [tb.select(list(range(r, n, world))) for r in range(world)]
    shares = broadcast_object(shares, src=0)
    return None if shares is None else shares[rank]


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
        return {metric_names.timer(k): v for k, v in out.items()}  # undeclared: a KeyError
