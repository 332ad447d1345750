"""Per-GPU placement by Ray: which node runs each process of a placed run, and which GPUs it owns.

Why Ray: it is what every peer (AReaL, veRL, OpenRLHF, slime) places trainer ranks and rollout
servers with. Each node joins the run's Ray cluster declaring its GPUs and its queue as a label
(``ray start --num-gpus N --labels oolong-node=node-<i>``, cloud-init's ``oolong-ray`` unit);
Ray keeps the accounting, places a group of bundles all or nothing, and picks the GPU indices a
task in each bundle sees (its ``CUDA_VISIBLE_DEVICES``). Prefect stays the orchestrator: every
process is still a flow run on its node's queue (flows/node_processes.py), started on the node
and GPUs Ray gave its bundle. The groups hold those GPUs until the run ends (or the flow process
dies: they belong to its Ray job), so another run on the same cluster waits for them rather than
landing on them.

The run's shape comes from ``placement.plan`` over the nodes as Ray sees them (its GPU counts, not
the provider's): how many trainer nodes, ranks on each, servers and their ``rollout.tp``. Ray then
decides where, in two groups:

- the trainer: one bundle per trainer node with that node's ranks' GPUs, ``STRICT_SPREAD`` (one
  ``torch.distributed.run`` per node, each on a node of its own), off ``server_nodes`` when the
  other nodes suffice;
- the rollout servers: one bundle per server with ``rollout.tp`` GPUs (a bundle never spans
  nodes), ``SPREAD``, on ``orchestration.placement.server_nodes`` when set.

Every bundle is restricted by label to the run's nodes. A group Ray cannot place in time is
removed and the run refused, naming what it asked for and what each node has.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestration.placement import Placement, PlacementError, ServerSlot, TrainerSlot, plan
from orchestration.providers.base import Node, NodeInventory, node_index, node_queue
from training_core.config import RunSpec

log = logging.getLogger("oolong.orchestration")
RAY_ADDRESS_ENV = "OOLONG_RAY_ADDRESS"
NODE_LABEL = "oolong-node"


def ray_address(inventory: NodeInventory) -> str | None:
    """The Ray cluster that places this run: the Terraform run's own (its ``ray_address``
    output), else ``$OOLONG_RAY_ADDRESS``; None: no Ray cluster (the built-in plan places)."""
    outputs = inventory.meta.get("outputs") or {}
    return outputs.get("ray_address") or os.environ.get(RAY_ADDRESS_ENV) or None


@dataclass
class Reservation:
    """The placement Ray made, and the groups that hold its GPUs until ``release``."""

    placement: Placement
    groups: list[Any] = field(default_factory=list)

    def release(self) -> list[str]:
        """Remove every group; never raises (a run's teardown must go on when the cluster is
        gone: its groups went with it). Returns what could not be removed, and why."""
        import ray
        from ray.util.placement_group import remove_placement_group

        failed = []
        if ray.is_initialized():  # else the session, and its groups with it, is gone already
            for group in self.groups:
                try:
                    remove_placement_group(group)
                except Exception as exc:  # noqa: BLE001 - reported, and the rest removed
                    failed.append(f"placement group {group.id.hex()}: {exc}")
                    log.warning("could not remove placement group: %s", exc)
        self.groups = []
        return failed


class PlacementCancelled(Exception):
    """The run was cancelled while its placement waited (for nodes, or for free GPUs)."""


CONNECT_ATTEMPTS = 3
CONNECT_PAUSE_S = 5.0


def connect(address: str) -> None:
    """Connect, or reconnect when the session is broken: a recovery may find the cluster
    restarted (its head's unit restarts it), and the session kept from before dead."""
    import ray

    if ray.is_initialized():
        try:
            ray.cluster_resources()
            return
        except Exception as exc:  # noqa: BLE001 - any failure: a new session
            log.warning("Ray session lost (%s): connecting again", exc)
            ray.shutdown()
    for attempt in range(CONNECT_ATTEMPTS):
        try:
            ray.init(address=address, namespace="oolong", log_to_driver=False,
                     logging_level="ERROR", configure_logging=False)
            return
        except ConnectionError as exc:
            # The Ray client's proxier starts a server per client; on a loaded head that server
            # can die while starting, and the next one usually comes up.
            if attempt + 1 == CONNECT_ATTEMPTS:
                raise
            log.warning("Ray connection to %s failed (%s): trying again", address, exc)
            ray.shutdown()
            time.sleep(CONNECT_PAUSE_S)


def ray_nodes(wanted: list[int], *, timeout_s: float,
              cancelled: Callable[[], bool] = lambda: False,
              poll_s: float = 1.0) -> dict[int, dict]:
    """The Ray node of each of the run's nodes in ``wanted`` (by its ``oolong-node`` label),
    once all of them have joined; raises after ``timeout_s`` naming the missing ones."""

    deadline = time.monotonic() + timeout_s
    while True:
        joined = _alive()
        missing = [node_queue(i) for i in wanted if i not in joined]
        if not missing:
            return {i: joined[i] for i in wanted}
        if cancelled():
            raise PlacementCancelled(f"cancelled while waiting for {missing} to join Ray")
        if time.monotonic() > deadline:
            raise PlacementError(
                f"nodes {missing} have not joined the Ray cluster after {timeout_s:.0f}s "
                "(orchestration.nodes_online_timeout_s): start Ray on them "
                f"(ray start --address <head> --labels {NODE_LABEL}=<node> --num-gpus <n>, "
                "cloud-init's oolong-ray unit) or read their setup log")
        time.sleep(poll_s)


def reserve(spec: RunSpec, inventory: NodeInventory, address: str, *, timeout_s: float,
            available: list[int] | None = None, name: str = "oolong",
            cancelled: Callable[[], bool] = lambda: False) -> Reservation:
    """Ask Ray to place the run on ``available`` (default: every node of ``inventory``); the
    returned reservation holds the GPUs until released. ``name`` prefixes the groups' names
    (``ray list placement-groups`` shows them)."""
    from ray.util.placement_group import placement_group

    connect(address)
    deadline = time.monotonic() + timeout_s
    if available is None:
        wanted = list(range(len(inventory.nodes)))
        joined = ray_nodes(wanted, timeout_s=timeout_s, cancelled=cancelled)
    else:  # a recovery: the nodes online both to Prefect and to Ray now, nobody waited for
        alive = _alive()
        wanted = [i for i in available if i in alive]
        if not wanted:
            raise PlacementError(f"none of {[node_queue(i) for i in available]} is alive in "
                                 "the Ray cluster")
        joined = {i: alive[i] for i in wanted}
    seen = NodeInventory([Node(n.address, int(joined[i]["Resources"].get("GPU", 0)) if i in joined
                               else 0, n.ssh_user, n.private_address)
                          for i, n in enumerate(inventory.nodes)], inventory.meta)
    shape = plan(spec, seen, available=wanted)
    gpus = any(seen.nodes[i].gpus for i in wanted)
    reservation = Reservation(shape)
    tag = uuid.uuid4().hex[:8]  # names must be unique in the cluster: one per attempt
    try:
        server_nodes = [i for i in spec.orchestration.placement.server_nodes or wanted
                        if i in wanted] or wanted
        # Servers held to some nodes: the trainer keeps off them when the other nodes suffice
        # (else it could take the room they are limited to, as Ray places group by group).
        others = [i for i in wanted if i not in server_nodes]
        trainer_nodes = others if len(others) >= len(shape.trainers) else wanted
        trainer_bundles = [_bundle(len(t.gpus), gpus) for t in shape.trainers]
        trainers = placement_group(trainer_bundles, strategy="STRICT_SPREAD",
                                   name=f"{name}-trainer-{tag}",
                                   bundle_label_selector=[_on(trainer_nodes)] * len(trainer_bundles))
        reservation.groups.append(trainers)
        server_bundles = [_bundle(s.tp, gpus) for s in shape.servers]
        servers = placement_group(server_bundles, strategy="SPREAD",
                                  name=f"{name}-servers-{tag}",
                                  bundle_label_selector=[_on(server_nodes)] * len(server_bundles))
        reservation.groups.append(servers)
        _wait_ready(trainers, "the trainer: " + _ask(trainer_bundles, "trainer node", distinct=True),
                    deadline, joined, cancelled)
        _wait_ready(servers, "the rollout servers: " + _ask(server_bundles, "server"),
                    deadline, joined, cancelled)
        trainer_owned = _owned(trainers, trainer_bundles)
        server_owned = _owned(servers, server_bundles)
    except BaseException:
        reservation.release()
        raise
    reservation.placement = Placement(
        tuple(TrainerSlot(rank, node, ids) for rank, (node, ids) in enumerate(trainer_owned)),
        tuple(ServerSlot(s.index, node, ids, s.tp)
              for s, (node, ids) in zip(shape.servers, server_owned, strict=True)))
    return reservation


def _alive() -> dict[int, dict]:
    """The run nodes' Ray nodes that are alive now, by node index (their oolong-node label)."""
    import ray

    return {index: node for node in ray.nodes()
            if node.get("Alive")
            and (index := node_index((node.get("Labels") or {}).get(NODE_LABEL, ""))) is not None}


def _bundle(gpus: int, with_gpus: bool) -> dict[str, float]:
    return {"CPU": 1.0, "GPU": float(gpus)} if with_gpus else {"CPU": 1.0}


def _on(nodes: list[int]) -> dict[str, str]:
    return {NODE_LABEL: f"in({','.join(node_queue(i) for i in nodes)})"}


def _ask(bundles: list[dict[str, float]], what: str, *, distinct: bool = False) -> str:
    gpus = int(bundles[0].get("GPU", 0)) if bundles else 0
    each = f"{gpus} GPU(s) and 1 CPU" if gpus else "1 CPU"
    return f"{len(bundles)} {what}(s) with {each} each" + (" on distinct nodes" if distinct else "")


def _wait_ready(group: Any, what: str, deadline: float, joined: dict[int, dict],
                cancelled: Callable[[], bool]) -> None:
    import ray
    from ray.exceptions import GetTimeoutError

    ready = group.ready()
    while True:
        try:  # in slices, so that a cancel is seen while Ray waits for GPUs to free up
            ray.get(ready, timeout=max(min(deadline - time.monotonic(), 2.0), 0.1))
            return
        except GetTimeoutError:
            if cancelled():
                raise PlacementCancelled(f"cancelled while waiting for GPUs for {what}") from None
            if time.monotonic() < deadline:
                continue
        free = ray.available_resources()
        have = ", ".join(f"{node_queue(i)}: {int(n['Resources'].get('GPU', 0))} GPU(s), "
                         f"{int(n['Resources'].get('CPU', 0))} CPU(s)" for i, n in joined.items())
        raise PlacementError(
            f"Ray could not place {what} in time (orchestration.nodes_online_timeout_s). The "
            f"run's nodes have {have}; free in the whole cluster now: "
            f"{int(free.get('GPU', 0))} GPU(s), {int(free.get('CPU', 0))} CPU(s) (other runs "
            "hold the rest): lower rollout.num_servers, rollout.tp or "
            "orchestration.placement.trainer_gpus_per_node, or add nodes") from None


def _where() -> tuple[str, tuple[int, ...]]:
    """Run inside a bundle: the node's label and the GPUs Ray gave the bundle (what it sets as
    this task's ``CUDA_VISIBLE_DEVICES``)."""
    import ray

    labels = ray.get_runtime_context().get_node_labels()
    return labels.get(NODE_LABEL, ""), tuple(int(g) for g in ray.get_gpu_ids())


def _owned(group: Any, bundles: list[dict[str, float]]) -> list[tuple[int, tuple[int, ...]]]:
    """Each bundle's node index and GPU indices, read by a task Ray runs inside it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    where = ray.remote(_where)
    refs = [where.options(num_cpus=1, num_gpus=bundle.get("GPU", 0.0),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              group, placement_group_bundle_index=i)).remote()
            for i, bundle in enumerate(bundles)]
    return [(node_index(label), ids) for label, ids in ray.get(refs)]
