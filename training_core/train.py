"""The asynchronous RL training loop. Read it top to bottom.

Rollout servers generate all the time (the executor's thread keeps episodes in flight within the
staleness bound); this loop only consumes. Each step, in seven parts:

    1. take a batch  2. tensors and advantages  3. proximal logprobs  4. update
    5. export the weights  6. PAUSE generation, the servers load them, RESUME
    7. start an evaluation (beside the next step), report, checkpoint

Generation pauses only for the weight load itself: exporting the weights happens before the pause
and checkpointing, evaluation and reporting after the resume. An evaluation runs beside the
next step, on the servers; only the next push waits for what is left of it. The parts the loop uses are wired
in run_setup.py (``Run``: every rank's parts, ``Run.rollout``: rank 0's rollout side); what a
step reports, and where it goes, is step_report.py; the metrics' names are in step_metrics.py.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
from training_core.evaluation import evaluate_sets
from training_core.proximal import proximal_rows
from training_core.run_setup import Run, build_run
from training_core.step_metrics import advantage_metrics
from training_core.step_report import StepReport
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
    if run.rollout is None:  # data-parallel ranks follow rank 0's collective calls on their shard
        return follow_rank0(run)
    side, trainer, sync, policy, algo = run.rollout, run.trainer, run.sync, run.policy, run.algo
    timers, refusals = Timers(), UpdateRefusals(spec, side.sink)
    report = StepReport(spec, side.sink, run.run_dir, side.tokenizer, side.profile,
                        first_step=run.first_step, progress=progress)
    evals = Evaluations(run, report)
    report.started(policy.current)
    side.executor.start()
    step = run.first_step - 1
    try:
        if evals.due_before_training():
            evals.start(step=0)  # the starting point, beside the first step
        report.step_started()
        for step in range(run.first_step, spec.trainer.steps + 1):

            # 1. Take the oldest B finished groups (blocks only if generation is behind).
            with timers("wait_rollout"):
                batch = side.executor.prepare_batch(spec.trainer.batch_groups, policy.current,
                                                    timeout_s=spec.rollout.batch_timeout_s)
            if refusals.rewards_refused(batch.groups, step, run.world):  # [issue 47] no NaN
                continue  # in (raises when it repeats): see training_core/update_guard.py
            metrics = report.batch_taken(step, policy.current, batch, algo)
            side.trained.add([g.prompt_index for g in batch.groups])  # .../seen_in_trained_batch

            # 2. Tensors and advantages (group-normalised outcome rewards, per preset).
            with timers("prepare"):
                tb = build_train_batch(batch.groups, pad_id=side.tokenizer.pad_token_id,
                                       algo=algo, max_new_tokens=spec.rollout.max_new_tokens)
                metrics.update(advantage_metrics(tb))
                tb = scatter_batch(tb, run.world)  # this rank's share (all of it with one process)

            # 3-5. Proximal logprobs, update, weight export: on every rank (collective_update).
            try:
                stats = collective_update(trainer, tb, algo, spec, sync, policy.current + 1,
                                          timers, side.threads)
            except NonFiniteUpdate as exc:  # [issue 47] refused before the step: nothing pushed
                refusals.refused(exc, batch.groups, step)  # raises when it repeats
                continue
            refusals.accepted()

            # 6. Pause generation only for the load, then advance the version: in-flight requests
            #    abort and are re-submitted with their partial output once generation continues.
            with timers("eval_wait"):  # an evaluation in flight finishes on the old weights
                evals.settle()
            with timers("weight_sync_pause"):
                side.call(push_weights(side.client, sync, policy))
            side.executor.kick()  # the staleness bound just moved: start more episodes

            # 7. Start an evaluation (it runs beside the next step), report, then checkpoint:
            #    generation is already running again. The step's line is written before its
            #    checkpoint completes, so a complete checkpoint of step N always has step N's
            #    metrics (a resume drops the lines after its checkpoint and trains those steps
            #    again). Checkpoint time lands in the next step's time/*.
            if evals.due_at(step):
                evals.start(step)
            report.step_done(step, policy.current, batch, stats, metrics,
                             running=side.staleness.stats().running, timings=timers.pop())
            saved = checkpoint_if_due(trainer, spec, run.run_dir, step, policy.current,
                                      lambda: {**side.executor.resume_state(),
                                               "undelivered": side.sink.undelivered()}, timers)
            report.checkpointed(step, policy.current, saved)
        evals.settle()
        if evals.final_version_missed(step):
            # The last steps were refused (update_guard): the final version still gets its eval.
            evals.evaluate_now(step)
        report.finished(step, policy.current)
    except BaseException as exc:
        evals.abandon()
        if run.world > 1:
            scatter_batch(None, run.world)  # tell the other ranks to stop
        report.failed(exc, step)
        raise
    finally:
        report.close()
        run.close()
    return RunResult(run.run_dir, policy.current, step, evals.first, evals.last,
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


class Evaluations:
    """When the loop evaluates (before the first step, every ``eval.every`` steps, the last
    step, and a final version the last steps left unevaluated) and the evaluation itself:
    greedy (and sampled, ``eval.samples``) on every eval set, on the rollout servers beside
    training. The trainer does not wait for it: an evaluation started after step N's push runs
    while step N+1 takes its batch and updates, and only the next push (which would change the
    weights under it) or the run's end waits for what is left (``time/eval_wait_s``, the cost to
    training; ``eval/seconds``, its own length). Its results are logged at the step it was taken
    at, with the version. Rows that failed are counted (eval/errors), the first failure evented."""

    def __init__(self, run: Run, report: StepReport):
        self.run, self.side, self.spec, self.report = run, run.rollout, run.spec, report
        self.enabled = bool(self.spec.eval.every and self.side.eval_sets)
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None
        self.version = -1  # the weight version last evaluated: the final one always is
        self._pending: tuple[concurrent.futures.Future, int, int, float, list[str]] | None = None

    def due_before_training(self) -> bool:
        return self.enabled and self.run.first_step == 1

    def due_at(self, step: int) -> bool:
        return self.enabled and (step % self.spec.eval.every == 0
                                 or step == self.spec.trainer.steps)

    def final_version_missed(self, step: int) -> bool:
        return (self.enabled and step >= self.run.first_step
                and self.version != self.run.policy.current)

    def start(self, step: int) -> None:
        """Evaluate the current weights on every set, beside the episodes; returns at once."""
        self.settle()
        sets, version, errors = self.side.eval_sets, self.run.policy.current, []
        coro = evaluate_sets(
            self.side.client, self.side.ctx, sets, max_new_tokens=self.spec.rollout.max_new_tokens,
            version=version, samples=self.spec.eval.samples, k=self.spec.eval.k,
            overlap=self.side.eval_overlap, errors=errors,
            seen={name: self.side.trained.fraction(rows) for name, rows in sets.items()})
        self._pending = (self.side.executor.submit_coro(coro), step, version,
                         time.perf_counter(), errors)
        self.version = version

    def settle(self) -> None:
        """Wait for the evaluation in flight, if any, and report it (before a push: the weights
        must not change under it)."""
        if self._pending is None:
            return
        future, step, version, started, errors = self._pending
        self._pending = None
        out = {**future.result(), metric_names.EVAL_SECONDS: time.perf_counter() - started}
        if errors:
            n = sum(len(rows) for rows in self.side.eval_sets.values())
            self.side.sink.event("eval_errors", f"{len(errors)} eval completions on {n} rows "
                                 f"failed (scored 0); first: {errors[0][:2000]}", step=step)
        if step == 0:  # before the first step: the run's starting point
            self.first = out
        self.last = out
        self.report.evaluated(step, version, out)

    def evaluate_now(self, step: int) -> None:
        self.start(step)
        self.settle()

    def abandon(self) -> None:
        """A failing run does not wait for its evaluation."""
        if self._pending is not None:
            self._pending[0].cancel()
            self._pending = None


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
