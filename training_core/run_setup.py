"""Everything a run wires before its first step, so that train.py can open with the loop.

:func:`build_run` makes the parts: on every rank the run directory, model, trainer and weight
sync, restored from the latest checkpoint on resume; on rank 0 also the rollout side: the
servers (embedded, or the spec's URLs), the rollout client, admission control, the prompt
stream, rewards, the workflow, the executor and the sinks, with the resume bookkeeping (prompts
that were in flight, truncated metric lines, the servers brought to the checkpoint's weights).
:meth:`Run.close` tears the rollout side down.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training_core.algorithms.presets import AlgorithmConfig, resolve_algorithm
from training_core.allocator import retain_freed_memory
from training_core.api import MetricsSink, SamplingParams, TrainEngine, WeightReceiver
from training_core.checkpoint import checkpoint_dir, latest_checkpoint
from training_core.checkpoint_store import CheckpointStore
from training_core.config import RunSpec, dump_spec
from training_core.data.datasets import LoadedData, PromptLoader, TrainedQuestions, load_run_data
from training_core.launch import new_server_key, start_fleet
from training_core.metric_names import DEFAULT_EVAL_SET
from training_core.metrics import JsonlSink, MultiSink, truncate_metrics
from training_core.models.loading import load_tokenizer
from training_core.models.paths import run_model_dir
from training_core.processes import Fleet
from training_core.rewards.pool import RewardPool
from training_core.rollout import RolloutExecutor
from training_core.rollout_profile import RolloutProfile
from training_core.staleness import StalenessManager
from training_core.thread_share import ThreadShare
from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer
from training_core.transport.rollout_client import RolloutClient
from training_core.transport.server_auth import SERVER_KEY_ENV
from training_core.transport.server_kind import check_server_kind
from training_core.transport.weight_sync import WeightSync, make_weight_sync, push_weights
from training_core.version import PolicyVersion
from training_core.workflows import load_workflow
from training_core.workflows.base import WorkflowContext
from training_core.world import barrier, local_rank, rank_and_world


@dataclass
class Resumed:
    version: int
    first_step: int
    state: dict[str, Any]  # the checkpoint's client state (loader position, pending prompts, ...)
    tag: str


@dataclass
class Rollout:
    """Rank 0's rollout side: the servers, the client, admission control, the workflow's
    executor, rewards, evaluation rows and the sinks. Every part is there (a run's other ranks
    have no rollout side at all, not one with empty parts)."""

    tokenizer: Any
    sink: MetricsSink
    client: RolloutClient
    staleness: StalenessManager
    rewards: RewardPool
    ctx: WorkflowContext
    executor: RolloutExecutor
    eval_sets: dict[str, list[dict[str, Any]]]  # name -> rows: the run's split, then eval.sets
    eval_overlap: dict[str, float]  # per eval set: its questions in the train pool
    trained: TrainedQuestions  # the questions training batches held (this process)
    threads: ThreadShare
    profile: RolloutProfile
    # Control calls (pause, weight load, resume) get their own event loop in the trainer's
    # thread: the executor's loop is busy with hundreds of in-flight requests and would delay them.
    control: asyncio.AbstractEventLoop
    fleet: Fleet | None  # the servers this run started; None when the spec gave their URLs

    def call(self, coro: Any) -> Any:
        """The one way the trainer's thread runs a control coroutine (pause, weight load,
        resume) and waits for it: on the control loop, never queued behind episodes (an
        evaluation, which uses the workflow's resources, starts on the executor's loop:
        ``executor.submit_coro``)."""
        return self.control.run_until_complete(coro)


@dataclass
class Run:
    """The parts of a run: every rank's, and on rank 0 the rollout side."""

    spec: RunSpec
    run_dir: Path
    algo: AlgorithmConfig
    trainer: TrainEngine
    sync: WeightSync
    policy: PolicyVersion  # the one owner of the policy version (training_core.version)
    first_step: int
    rank: int
    world: int
    rollout: Rollout | None = None  # rank 0 only

    def close(self) -> None:
        """The rollout side, in order: the weight group and the client's connections, the
        executor, the profile, the reward workers, the sinks, the servers."""
        side = self.rollout
        if side is None:
            return
        try:
            side.control.run_until_complete(_close_control(side.client, self.sync))
            side.control.close()
        finally:
            for part in (side.executor.stop, side.profile.close, side.rewards.close,
                         side.sink.close, side.fleet and side.fleet.stop):
                if part:
                    part()


def build_run(spec: RunSpec, *, resume_dir: str | Path | None = None,
              sink: MetricsSink | None = None) -> Run:
    run_dir = Path(resume_dir) if resume_dir else default_run_dir(spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_spec(spec, run_dir / "spec.yaml")
    torch.set_num_threads(spec.trainer.threads)
    retain_freed_memory()  # the trainer allocates the same activations every step (allocator.py)
    seed_everything(spec.seed)

    # ---- every rank: model, algorithm, trainer, weight sync; a resume restores them ----------
    model_dir = run_model_dir(spec, run_dir)
    algo = resolve_algorithm(spec.algorithm.preset, **spec.algorithm.model_dump(
        exclude={"preset", "rollout_correction"}))
    trainer = DeepSpeedTrainer(
        model_dir, lr=spec.trainer.lr, weight_decay=spec.trainer.weight_decay,
        grad_clip=spec.trainer.grad_clip, zero_stage=spec.trainer.zero_stage,
        dtype=spec.model.dtype, dist_backend=spec.trainer.dist_backend,
        temperature=spec.rollout.temperature, micro_batch_tokens=spec.trainer.micro_batch_tokens,
        keep_reference=algo.kl_coef > 0, share_prefixes=spec.trainer.share_prefixes,
        activation_checkpointing=spec.trainer.activation_checkpointing,
        lora=spec.model.lora)
    rank, world = rank_and_world()
    sync = make_weight_sync(spec.weight_sync, run_dir)
    resumed = restore(trainer, run_dir, sync) if resume_dir else None
    policy = PolicyVersion(resumed.version if resumed else 0)
    run = Run(spec, run_dir, algo, trainer, sync, policy, resumed.first_step if resumed else 1,
              rank, world)
    if rank != 0:  # data-parallel ranks train on their shard; rank 0 owns everything else
        return run

    # ---- rank 0: the rollout side ---------------------------------------------------------------
    tokenizer = load_tokenizer(model_dir)
    data = load_run_data(spec)
    # The run's server key: the launcher's (a flow-started trainer), else a new one for the
    # servers started here; given servers that want one are given it in OOLONG_SERVER_KEY.
    server_key = os.environ.get(SERVER_KEY_ENV) or new_server_key()
    fleet = None
    if spec.rollout.server_urls:
        urls = list(spec.rollout.server_urls)
    else:
        # A resumed run samples with a fresh seed: replaying the first run's random stream would
        # repeat its samples.
        fleet = start_fleet(spec, model_dir, run_dir, seed=server_seed(spec.seed, policy.current),
                            gpus=torch.cuda.device_count(), trainer_gpus=world,
                            server_key=server_key)
        urls = fleet.urls
    client = RolloutClient(urls, timeout_s=spec.rollout.request_timeout_s,
                           max_interruptions=spec.rollout.max_interruptions,
                           pause_mode=spec.rollout.interrupt_mode, version=policy,
                           api_key=server_key,
                           flush_after_in_place=spec.rollout.backend == "sglang")
    staleness = StalenessManager(batch_groups=spec.trainer.batch_groups,
                                 max_staleness=spec.rollout.max_staleness,
                                 max_concurrent=spec.rollout.max_concurrent)
    loader = PromptLoader(data.train, spec.seed)
    sink = sink or make_sinks(spec, run_dir)
    control = asyncio.new_event_loop()
    try:
        _build_rollout(run, spec, tokenizer, data, sink, client, staleness, loader, control, fleet)
        _resume_rollout(run, resumed, loader, bool(resume_dir))
    except BaseException:  # nothing this rank started outlives the failure
        if run.rollout is not None:
            run.close()
        else:
            _abandon(control, client, sync, sink, fleet)
        raise
    return run


def _build_rollout(run: Run, spec: RunSpec, tokenizer: Any, data: Any, sink: MetricsSink,
                   client: RolloutClient, staleness: StalenessManager, loader: PromptLoader,
                   control: asyncio.AbstractEventLoop, fleet: Fleet | None) -> None:
    """Connect to the servers, then make the workflow, rewards and executor: ``run.rollout``."""
    control.run_until_complete(check_server_kind(client, spec.rollout.backend))
    control.run_until_complete(run.sync.connect(client))
    sampling = SamplingParams(max_new_tokens=spec.rollout.max_new_tokens,
                              temperature=spec.rollout.temperature, top_p=spec.rollout.top_p,
                              top_k=spec.rollout.top_k)
    rewards = RewardPool.from_spec(spec.reward)
    ctx = WorkflowContext(
        tokenizer=tokenizer, rewards=rewards, sampling=sampling,
        group_size=spec.rollout.group_size, prompt_template=spec.data.prompt_template,
        chat_template=spec.data.chat_template, max_turns=spec.rollout.max_turns,
        turn_discount=spec.rollout.turn_discount, agent=spec.rollout.agent)
    online = spec.rollout.mode == "online"
    workflow = load_workflow("online" if online else spec.rollout.workflow, ctx)
    ctx.evaluate_episode = getattr(workflow, "aevaluate", None)  # agents evaluate their way
    if online:  # the gateway's URL (never its key) in the run's events
        workflow.file = run.run_dir / "gateway.json"  # always there: no spec field names a path
        workflow.on_ready = lambda url: sink.event("gateway", f"online gateway at {url}",
                                                   url=url)
    try:
        executor = RolloutExecutor(client, workflow, loader, staleness,
                                   dynamic_filter=run.algo.dynamic_filter,
                                   max_token_staleness=spec.rollout.token_staleness_bound)
    except BaseException:
        rewards.close()
        raise
    run.rollout = Rollout(
        tokenizer=tokenizer, sink=sink, client=client, staleness=staleness, rewards=rewards,
        ctx=ctx, executor=executor, eval_sets=eval_sets(data, spec.eval.size),
        eval_overlap=data.overlap, trained=TrainedQuestions(data.train, spec.seed),
        threads=ThreadShare(spec, fleet, executor, run.world),
        profile=RolloutProfile(client), control=control, fleet=fleet)


def eval_sets(data: LoadedData, size: int) -> dict[str, list[dict[str, Any]]]:
    """The sets a run evaluates: its own held-out split (``eval.size`` of it) and the named
    ``eval.sets`` (sized when loaded), leaving out empty ones."""
    sets = {name: rows[:size] if name == DEFAULT_EVAL_SET else rows
            for name, rows in data.eval_sets.items()}
    return {name: rows for name, rows in sets.items() if rows}


def _abandon(control: asyncio.AbstractEventLoop, client: RolloutClient, sync: WeightSync,
             sink: MetricsSink, fleet: Fleet | None) -> None:
    """Tear down what a rank 0 that failed to connect had started (its Rollout never existed)."""
    try:
        control.run_until_complete(_close_control(client, sync))
        control.close()
    finally:
        sink.close()
        if fleet is not None:
            fleet.stop()


def _resume_rollout(run: Run, resumed: Resumed | None, loader: PromptLoader,
                    resuming: bool) -> None:
    """Bring the rollout side to the checkpoint: its prompts, admission counters, metric lines
    and the servers' weights; or check that fresh servers start at version 0."""
    side = run.rollout
    if resumed is not None:
        # Prompts in flight or buffered at the checkpoint were never trained on: hand them out
        # again first (checkpoints from before this existed carry only the position).
        state = resumed.state
        loader.restore(state["loader_position"], state.get("pending_prompts"))
        side.staleness.recover(run.policy.current)
        dropped = truncate_metrics(run.run_dir, state["step"])
        # What the tracker had not received at the checkpoint may have died with its node.
        side.sink.redeliver(state.get("undelivered", []))
        # The servers load the checkpoint's weights, as the checkpoint's own version.
        side.call(push_weights(side.client, run.sync, run.policy, advance=False))
        side.sink.event("resumed", f"resumed from {resumed.tag} at version {run.policy.current}",
                        step=state["step"], discarded_metric_lines=dropped,
                        requeued_prompts=len(state.get("pending_prompts", [])))
    else:
        side.call(side.client.check_versions(0))
        if resuming:
            truncate_metrics(run.run_dir, 0)
            side.sink.event("resumed", "no complete checkpoint; starting from step 1")


def restore(trainer: TrainEngine, run_dir: Path, sync: WeightSync) -> Resumed | None:
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
    sync.export(trainer, state["version"], resumed=True)
    return Resumed(state["version"], state["step"] + 1, state, found[1])


async def _close_control(client: WeightReceiver | None, sync: WeightSync) -> None:
    if client is None:
        return
    try:
        await sync.close(client)
    finally:
        await client.aclose()


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


def server_seed(seed: int, version: int) -> int:
    """The embedded servers' sampling seed: the run's seed at the start, a different one for
    each version a run resumes at (deterministic, so a resumed run is reproducible)."""
    return seed if version == 0 else (seed * 1_000_003 + version * 7_919) % 2**31
