"""The `training-run` flow: provision -> rollout fleet -> trainer -> supervise -> tear down.

Every step is a task that does one thing; the flow only orchestrates. Status and events go to
the web app over HTTP with the run's ingest token (this process holds no database credentials).
Whatever happens, ``finally`` stops every process of the run, releases the nodes and reports the
final status with its reason.

Where the run goes is the provider's choice, not the node count's: ``local`` runs every process
on this machine; any other provider places every process on its nodes through Prefect, one node
included (``run_placed``). No secret is a parameter: this flow's token comes from its
environment (local mode) or sealed with the control plane's key (server mode); the nodes get a
credential of their own, sealed with the run's node key (sealing.py).

Local mode (no Prefect server): ``python -m orchestration.flows.training_run --run-id ...``
runs it on Prefect's ephemeral engine. Server mode: the `training-run` deployment in
platform/prefect.yaml, picked up by a worker of the `oolong` process work pool.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from orchestration import launchers
from orchestration.deployments import deploy_node_flows
from orchestration.model_delivery import publish_model
from orchestration.placed import PlacedRun, node_pool, online_nodes, wait_nodes_online
from orchestration.placement import Placement, PlacementError, plan, shared_plan
from orchestration.providers import NodeInventory, NodeProvider, get_provider
from orchestration.providers.base import node_queue
from orchestration.ray_placement import PlacementCancelled, Reservation, ray_address, reserve
from orchestration.sealing import NODE, RunCredential
from orchestration.supervise import Outcome, supervise
from orchestration.tracker import Tracker
from orchestration.trigger import flow_credential, flow_run_dir, sweep_dir
from training_core.checkpoint import current_weights
from training_core.config import RunSpec
from training_core.launch import (
    check_nccl,
    run_env,
    server_command,
    server_env,
    server_mem_fraction,
    server_process,
    trainer_command,
)
from training_core.models.paths import run_model_dir, spec_model_dir
from training_core.ports import free_port
from training_core.processes import Fleet, ManagedProcess, stop_all
from training_core.transport.rollout_client import RolloutClient
from training_core.transport.server_auth import derive_server_key


@dataclass
class RunProcesses:
    fleet: Fleet | None = None
    trainer: ManagedProcess | None = None


@task(name="provision-nodes", cache_policy=NO_CACHE)  # side effects: never cached
def provision_nodes(provider_name: str, run_id: int, spec: dict) -> NodeInventory:
    return get_provider(provider_name).provision(run_id, spec)


@task(name="prepare-run", cache_policy=NO_CACHE)  # side effects: never cached
def prepare_run(cred: RunCredential, run_dir: Path) -> tuple[RunSpec, Path]:
    from training_core.remote_run import prepare_remote_run

    return prepare_remote_run(cred.tracker_url, cred.token, run_dir)


@task(name="deliver-model", cache_policy=NO_CACHE)  # side effects: never cached
def deliver_model(store_url: str, run_id: int, spec: RunSpec) -> str:
    """The model the spec names, into the run's store once (the nodes fetch it by hash)."""
    return publish_model(store_url, f"run-{run_id}", spec_model_dir(spec))


@task(name="warm-start", cache_policy=NO_CACHE)  # side effects: never cached
def warm_start(spec: RunSpec, spec_path: Path, run_dir: Path,
               share: Path | None = None) -> Path | None:
    return launchers.warm_start(spec, spec_path, run_dir, share=share)


@task(name="start-rollout-fleet", cache_policy=NO_CACHE)  # side effects: never cached
def start_rollout_fleet(spec: RunSpec, run_dir: Path, inventory: NodeInventory,
                        placement: Placement, server_key: str) -> Fleet:
    model_dir = str(run_model_dir(spec, run_dir))
    check_nccl(spec)
    fleet = Fleet(urls=[])
    host = inventory.head.address
    for slot in placement.servers:
        port = free_port()
        url = f"http://{host}:{port}"
        fleet.urls.append(url)
        fraction = server_mem_fraction(
            spec, model_dir, shares_trainer_gpu=placement.shares_trainer_gpu(slot),
            gpu_index=slot.gpus[0] if slot.gpus else 0, trainer_ranks=placement.trainers[0].nproc)
        cmd = server_command(spec, model_dir, port, slot.index, parent_pid=os.getpid(),
                             mem_fraction=fraction, run_dir=run_dir, server_key=server_key)
        fleet.servers.append(server_process(
            f"rollout server {slot.index}", cmd, url,
            run_dir / "logs" / f"rollout-server-{slot.index}.log",
            server_env(spec, run_dir, gpus=slot.gpus, server_key=server_key)).start())
    return fleet


@task(name="wait-fleet-healthy", cache_policy=NO_CACHE)  # side effects: never cached
def wait_fleet_healthy(fleet: Fleet, timeout_s: float = 300.0) -> None:
    fleet.wait_healthy(timeout_s)


@task(name="start-trainer", cache_policy=NO_CACHE)  # side effects: never cached
def start_trainer(spec_path: Path, fleet: Fleet, placement: Placement,
                  run_dir: Path, resume: bool = False,
                  server_key: str | None = None) -> ManagedProcess:
    slot = placement.trainers[0]
    cmd = trainer_command(spec_path, fleet.urls, run_dir, nproc=slot.nproc, resume=resume)
    (run_dir / "trainer.cmd").write_text(" ".join(cmd))
    return ManagedProcess("trainer", cmd, run_dir / "logs" / "trainer.log",
                          env=run_env(run_dir, gpus=slot.gpus, server_key=server_key)).start()


@task(name="tear-down", cache_policy=NO_CACHE)  # side effects: never cached
def tear_down(procs: RunProcesses) -> None:
    """Every process of the run, trainer and servers together, under one deadline."""
    stop_all([procs.trainer, *(procs.fleet.servers if procs.fleet else [])], grace_s=10.0)


def load_current_weights(run_dir: Path, url: str, server_key: str | None = None) -> None:
    """Bring a restarted server to the trainer's latest pushed weights (``weight_sync: disk``),
    checking its reply. With ``distributed`` the trainer rebuilds its weight group with the
    server before its next push (it sees the server's older ``weight_version``)."""
    current = current_weights(run_dir)
    if current is None:
        return
    version, path = current

    async def load() -> None:
        client = RolloutClient([url], api_key=server_key)
        try:
            await client.update_weights_from_disk(str(path.resolve()), version)
        finally:
            await client.aclose()

    asyncio.run(load())


def place_on_nodes(spec: RunSpec, inventory: NodeInventory, run_id: int,
                   available: list[int] | None = None,
                   cancelled: Callable[[], bool] = lambda: False,
                   ) -> tuple[Placement, Reservation | None, str]:
    """Where each process of a run across nodes goes, and by whom: Ray's placement groups when
    the run has a Ray cluster (Terraform's, or ``$OOLONG_RAY_ADDRESS``); without one, only
    nodes without GPUs (nothing per GPU to place: the built-in plan spreads the processes)."""
    address = ray_address(inventory)
    if address:
        held = reserve(spec, inventory, address, available=available, name=f"oolong-run-{run_id}",
                       timeout_s=spec.orchestration.nodes_online_timeout_s, cancelled=cancelled)
        return held.placement, held, f"by Ray at {address}"
    if any(node.gpus for node in inventory.nodes):
        raise PlacementError(
            "GPU nodes are placed by Ray, and this run has no Ray cluster: start one (ray start "
            "--head on the control machine, ray start --address <head> --num-gpus <n> --labels "
            "oolong-node=node-<i> on each node) and set OOLONG_RAY_ADDRESS for the flow's worker "
            "(docs/clusters.md)")
    return plan(spec, inventory, available=available), None, "built-in, nodes without GPUs"


def placement_event(tracker: Tracker, placement: Placement, how: str = "") -> None:
    """The plan every attempt starts from, on the run's event log (the dashboard's placement)."""
    tracker.event("placement", f"placement plan{f' ({how})' if how else ''}: "
                               + "; ".join(placement.describe()), plan=placement.as_dict())


def prepare_placed(prov: NodeProvider, run_id: int, cred: RunCredential, spec: RunSpec,
                   inventory: NodeInventory, tracker: Tracker) -> PlacedRun | None:
    """Everything a run on nodes needs before its first process: the nodes' own credential
    (sealed with the run's node key), the model in the run's store, the provider's nodes online
    when they are the run's own (cloud nodes boot for minutes after ``terraform apply``), and the
    placement (refused here, before any process, when it cannot fit). None: cancelled meanwhile."""
    node_token = tracker.node_credential(prov.name)
    sealed = RunCredential(run_id, cred.tracker_url, node_token).seal(
        prov.node_key(run_id), purpose=NODE)
    store = prov.store_url(spec.model_dump(mode="json"))
    model_sha256 = ""
    if store:
        model_sha256 = deliver_model(store, run_id, spec)
        tracker.event("model", f"model {spec.model.path} in the run's store (manifest sha256 "
                               f"{model_sha256}): every node fetches and checks it",
                      sha256=model_sha256)
    else:
        tracker.event("model", f"no store for the run: each node resolves model.path "
                               f"{spec.model.path!r} itself")
    pool = node_pool(run_id, inventory)
    orch = spec.orchestration
    if inventory.meta.get("dedicated"):
        every = list(range(len(inventory.nodes)))
        tracker.event("nodes", f"waiting for the run's {len(every)} node(s) to come up in pool "
                               f"{pool} (at most {orch.nodes_online_timeout_s:.0f}s)")
        if not wait_nodes_online(pool, every, timeout_s=orch.nodes_online_timeout_s,
                                 fresh_s=orch.worker_lost_after_s,
                                 cancelled=tracker.cancel_requested):
            return None
    try:
        placement, held, how = place_on_nodes(spec, inventory, run_id,
                                              cancelled=tracker.cancel_requested)
    except PlacementCancelled:
        return None
    placement_event(tracker, placement, how)
    return PlacedRun(run_id, sealed, spec, inventory, placement, pool, reservation=held,
                     model_sha256=model_sha256, server_key=derive_server_key(node_token))


def run_placed(placed: PlacedRun, tracker: Tracker, *, resume: bool = False) -> Outcome:
    """The run across nodes: once the nodes' workers are online, servers on theirs, then one
    trainer launcher per trainer node. A lost node or process is recovered automatically: the
    run resumes from the durable store on the nodes still online, up to
    ``orchestration.max_restarts`` times, each recovery an event."""
    spec = placed.spec
    orch = spec.orchestration
    if spec.rollout.server_urls:
        raise ValueError("rollout.server_urls: a placed run starts its own servers")

    needed = sorted(set(placed.placement.trainer_nodes + placed.placement.server_nodes))
    tracker.event("nodes", f"waiting for the workers of {', '.join(map(node_queue, needed))} in "
                           f"pool {placed.pool} (at most {orch.nodes_online_timeout_s:.0f}s)")
    if not wait_nodes_online(placed.pool, needed, timeout_s=orch.nodes_online_timeout_s,
                             fresh_s=orch.worker_lost_after_s, cancelled=tracker.cancel_requested):
        return Outcome("cancelled", "cancelled by user")
    deploy_node_flows(placed.pool)  # into the pool the nodes' workers created
    if spec.model.warm_start_seconds > 0:
        node = node_queue(placed.placement.trainer_nodes[0])
        tracker.event("warm_start", f"supervised warm start for at most "
                                    f"{spec.model.warm_start_seconds:.0f}s on {node}; every node "
                                    "fetches the model from the durable store")
        if not placed.warm_start(tracker.cancel_requested):
            return Outcome("cancelled", "cancelled by user")
    restarts = 0
    lost: set[int] = set()
    while True:
        outcome = _placed_attempt(placed, tracker, resume=resume)
        if not (outcome.status == "failed" and outcome.recoverable
                and restarts < orch.max_restarts):
            return outcome
        restarts += 1
        lost |= set(outcome.lost_nodes)
        left = placed.stop()
        online = [i for i in online_nodes(placed.pool, len(placed.inventory.nodes),
                                          orch.worker_lost_after_s) if i not in lost]
        try:
            placement, held, how = place_on_nodes(spec, placed.inventory, placed.run_id,
                                                  available=online, cancelled=tracker.cancel_requested)
        except PlacementCancelled:
            return Outcome("cancelled", "cancelled by user")
        placed.reset(placement, held)  # the run owns the new hold from here on (stop releases it)
        tracker.event("recovery", f"{outcome.reason.splitlines()[0]}; resuming from the durable "
                                  f"store on {', '.join(map(node_queue, online))} (recovery "
                                  f"{restarts}/{orch.max_restarts})" + (
                                      f"; not stopped in time: {left}" if left else ""),
                      lost=[node_queue(n) for n in sorted(lost)])
        placement_event(tracker, placement, how)
        resume = True


def _placed_attempt(placed: PlacedRun, tracker: Tracker, *, resume: bool) -> Outcome:
    urls = placed.start_servers()
    tracker.event("fleet", f"{len(urls)} rollout server(s) healthy", urls=urls)
    placed.start_trainers(urls, resume=resume)
    tracker.status("running")
    tracker.event("trainer", "trainer placed on " + ", ".join(
        node_queue(n) for n in placed.placement.trainer_nodes) + " (weights over the network)")
    outcome = placed.supervise(tracker)
    versions = placed.server_versions()
    tracker.event("fleet", "rollout servers end at weight_version " + ", ".join(versions),
                  versions=versions)
    return outcome


@flow(name="training-run", log_prints=True)
def training_run(run_id: int, provider: str = "local", resume: bool = False, sealed: str = "",
                 tracker_url: str = "") -> str:
    """``sealed``: the run's credential and the web app's URL, sealed with the control plane's
    key (server mode); else the token comes from ``OOLONG_INGEST_TOKEN`` and the URL is
    ``tracker_url`` (local mode). Never the token itself: parameters are readable through
    Prefect's API."""
    logger = get_run_logger()
    cred = flow_credential(run_id, sealed=sealed, tracker_url=tracker_url)
    tracker = Tracker(cred.tracker_url, cred.token)
    run_dir = flow_run_dir(run_id)
    procs = RunProcesses()
    placed: PlacedRun | None = None
    outcome = Outcome("failed", "the flow stopped before the trainer started")
    prov = get_provider(provider)
    try:
        info = tracker.run_info()
        if info.get("cancel_requested"):
            outcome = Outcome("cancelled", "cancelled before start")
            return outcome.status
        tracker.status("provisioning")
        how = f"provider {provider}" + (", resuming from the latest checkpoint" if resume else "")
        tracker.event("flow", f"flow started ({how}); run directory {run_dir}")
        inventory = provision_nodes(provider, run_id, info["spec"])
        spec, spec_path = prepare_run(cred, run_dir)
        if provider != "local":  # every process on a node's work queue, one node included
            placed = prepare_placed(prov, run_id, cred, spec, inventory, tracker)
            if placed is None:
                outcome = Outcome("cancelled", "cancelled by user")
                return outcome.status
            outcome = run_placed(placed, tracker, resume=resume)
            return outcome.status
        try:  # refused here, before any process, if it cannot fit
            placement = plan(spec, inventory)
        except PlacementError as exc:
            placement = shared_plan(spec, inventory)  # one machine: its GPUs are shared
            tracker.event("placement", f"GPUs shared by the trainer and the servers ({exc})")
        placement_event(tracker, placement)
        sweep = info.get("sweep") or {}
        share = sweep_dir(sweep["id"]) if sweep.get("share_warm_start") else None
        if spec.model.warm_start_seconds > 0:
            tracker.event("warm_start", f"supervised warm start for at most "
                                        f"{spec.model.warm_start_seconds:.0f}s" + (
                                            f", shared with the runs of sweep {sweep['id']}"
                                            if share else ""))
        warm_start(spec, spec_path, run_dir, share)
        # the run's server key, derived from its credential (no second secret travels)
        key = derive_server_key(cred.token)
        procs.fleet = start_rollout_fleet(spec, run_dir, inventory, placement, key)
        wait_fleet_healthy(procs.fleet)
        tracker.event("fleet", f"{len(procs.fleet.urls)} rollout server(s) healthy",
                      urls=procs.fleet.urls)
        procs.trainer = start_trainer(spec_path, procs.fleet, placement, run_dir, resume,
                                      server_key=key)
        tracker.status("running")
        tracker.event("trainer", f"trainer started (pid {procs.trainer.pid})")

        def restart_server(i: int) -> None:
            procs.fleet.restart(i, bring_up=lambda url: load_current_weights(run_dir, url, key))

        outcome = supervise(tracker, procs.trainer, procs.fleet, run_dir,
                            trainer_log=procs.trainer.log,
                            restart_server=restart_server, stop_trainer=procs.trainer.stop,
                            heartbeat_timeout_s=spec.orchestration.heartbeat_timeout_s,
                            max_server_restarts=spec.orchestration.max_server_restarts)
        return outcome.status
    except BaseException as exc:
        outcome = Outcome("failed", f"{type(exc).__name__}: {exc}")
        logger.error("training-run failed: %s", exc)
        raise
    finally:
        if placed is not None:
            try:  # whatever happens here, the nodes are released below
                left = placed.stop()
            except Exception as exc:  # noqa: BLE001 - e.g. Prefect's API gone
                left = [f"the placed processes ({type(exc).__name__}: {exc})"]
            if left:
                outcome = Outcome("failed", f"{outcome.reason}; not stopped in time: {left}")
        tear_down(procs)
        try:
            prov.release(run_id)
        except Exception as exc:  # noqa: BLE001 - report, but the status must still be sent
            outcome = Outcome("failed", f"{outcome.reason}; node release failed: {exc}")
        tracker.event("flow", f"finished: {outcome.status}" + (f" ({outcome.reason.splitlines()[0]})"
                                                                 if outcome.reason else ""))
        try:
            tracker.status(outcome.status, outcome.reason)
        finally:
            tracker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run the training-run flow in this process")
    parser.add_argument("--run-id", type=int, required=True)
    parser.add_argument("--tracker-url", required=True)
    parser.add_argument("--provider", default="local")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint (a resumed attempt)")
    args = parser.parse_args(argv)
    # the run's token: OOLONG_INGEST_TOKEN in this process's environment (never an argument:
    # visible in ps; never a flow parameter: visible through Prefect's API)
    status = training_run(args.run_id, args.provider, args.resume, tracker_url=args.tracker_url)
    return 0 if status == "succeeded" else 1


if __name__ == "__main__":
    raise SystemExit(main())
