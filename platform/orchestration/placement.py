"""The placement plan: which node runs what, on which of its GPUs, before anything starts.

Pure data from the run spec and the provider's nodes (each declares its GPU count):

- rollout server ``i`` owns ``rollout.tp`` GPUs of one node (SGLang ``--tp-size``; the process
  sees only them through ``CUDA_VISIBLE_DEVICES``). Servers go round-robin over the server nodes,
  each to the next node in turn with that many GPUs still free, lowest indices first;
- each trainer node runs ``nproc_per_node`` ranks, one per GPU given to training
  (``orchestration.placement.trainer_gpus_per_node``, default every GPU the servers left);
- nodes that declare no GPU (CPU machines, loopback test nodes without a count) run one trainer
  rank and any number of servers, with no device assignment.

A plan that does not fit raises ``PlacementError`` naming the field and what is missing, before a
process starts. The same plan is what a Ray placement group would be given (``bundles``): one
bundle per process with its GPU count, the trainer's packed on their node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from orchestration.providers.base import NodeInventory, node_queue
from training_core.config import RunSpec
from training_core.launch import single_machine_gpus


class PlacementError(ValueError):
    """The run does not fit the nodes; the message names the field and what is missing."""


@dataclass(frozen=True)
class ServerSlot:
    index: int
    node: int
    gpus: tuple[int, ...]  # empty: a node without declared GPUs
    tp: int

    def describe(self) -> str:
        return f"rollout server {self.index} on {node_queue(self.node)}" + _on(self.gpus, self.tp)


@dataclass(frozen=True)
class TrainerSlot:
    node_rank: int
    node: int
    gpus: tuple[int, ...]

    @property
    def nproc(self) -> int:
        return max(len(self.gpus), 1)

    def describe(self) -> str:
        return (f"trainer node {self.node_rank} on {node_queue(self.node)}: {self.nproc} rank(s)"
                + (f", GPUs {_gpu_list(self.gpus)}" if self.gpus else ""))


@dataclass(frozen=True)
class Placement:
    trainers: tuple[TrainerSlot, ...]
    servers: tuple[ServerSlot, ...]

    @property
    def trainer_nodes(self) -> list[int]:
        return [t.node for t in self.trainers]

    @property
    def server_nodes(self) -> list[int]:  # one entry per server
        return [s.node for s in self.servers]

    def describe(self) -> list[str]:
        return [t.describe() for t in self.trainers] + [s.describe() for s in self.servers]

    def as_dict(self) -> dict:
        """The plan as the run page shows it (an event's payload)."""
        return {"trainers": [{"node": node_queue(t.node), "node_rank": t.node_rank,
                              "nproc_per_node": t.nproc, "gpus": list(t.gpus)}
                             for t in self.trainers],
                "servers": [{"index": s.index, "node": node_queue(s.node), "tp": s.tp,
                             "gpus": list(s.gpus)} for s in self.servers]}

    def shares_trainer_gpu(self, server: ServerSlot) -> bool:
        """Whether a trainer rank runs on one of ``server``'s GPUs (a shared plan)."""
        return any(t.node == server.node and set(t.gpus) & set(server.gpus) for t in self.trainers)

    def bundles(self) -> list[dict[str, float]]:
        """The plan as Ray placement-group bundles (one per rank or server)."""
        per_rank = [{"CPU": 1.0, "GPU": 1.0 if t.gpus else 0.0} for t in self.trainers
                    for _ in range(t.nproc)]
        return per_rank + [{"CPU": 1.0, "GPU": float(len(s.gpus))} for s in self.servers]


def plan(spec: RunSpec, inventory: NodeInventory, available: list[int] | None = None) -> Placement:
    """``available``: plan on these nodes only (a recovery, without the lost ones); node indices
    in the plan stay those of ``inventory`` (their queues), ``server_nodes`` keeps those of its
    nodes that are still there (all of them when none is)."""
    if available is not None:
        return _plan_on(spec, inventory, available)
    n = len(inventory.nodes)
    wanted = spec.orchestration.placement
    tp = spec.rollout.tp
    if wanted.trainer_nodes > n:
        raise PlacementError(f"orchestration.placement.trainer_nodes is {wanted.trainer_nodes} "
                             f"but the provider gave {n} node(s)")
    trainer_nodes = list(range(wanted.trainer_nodes))
    pool = (wanted.server_nodes or [i for i in range(n) if i not in trainer_nodes]
            or list(range(n)))
    bad = [i for i in pool if not 0 <= i < n]
    if bad:
        raise PlacementError(f"orchestration.placement.server_nodes {bad}: nodes are 0..{n - 1}")
    gpus = [node.gpus for node in inventory.nodes]
    if any(gpus) and not all(gpus[i] for i in set(pool) | set(trainer_nodes)):
        empty = [node_queue(i) for i in sorted(set(pool) | set(trainer_nodes)) if not gpus[i]]
        raise PlacementError(f"nodes {empty} declare no GPU while others do: give every node its "
                             "GPU count (the provider's node list), or none of them")
    free = [list(range(g)) for g in gpus]  # each node's GPU indices nobody owns yet
    servers = _place_servers(spec.rollout.num_servers, tp, pool, free, gpus)
    trainers = []
    for rank, node in enumerate(trainer_nodes):
        if not gpus[node]:
            trainers.append(TrainerSlot(rank, node, ()))
            continue
        take = wanted.trainer_gpus_per_node or len(free[node])
        if take == 0 or take > len(free[node]):
            owned = gpus[node] - len(free[node])
            raise PlacementError(
                f"trainer node {rank} ({node_queue(node)}) needs "
                f"{take or 'at least 1'} GPU(s) (orchestration.placement.trainer_gpus_per_node) "
                f"but has {len(free[node])} free of {gpus[node]} ({owned} owned by rollout "
                "servers): lower rollout.num_servers or rollout.tp, set "
                "orchestration.placement.server_nodes to other nodes, or add nodes")
        trainers.append(TrainerSlot(rank, node, tuple(free[node][:take])))
        del free[node][:take]
    sizes = {t.nproc for t in trainers}
    if len(sizes) > 1:
        raise PlacementError(f"trainer nodes would run {sorted(sizes)} ranks each (torchrun "
                             "needs the same nproc_per_node on every node): set "
                             "orchestration.placement.trainer_gpus_per_node")
    return Placement(tuple(trainers), tuple(servers))


def shared_plan(spec: RunSpec, inventory: NodeInventory) -> Placement:
    """One machine whose GPUs cannot give every server its own and still leave the trainer one
    (one GPU and one server): the servers take disjoint GPUs, the trainer a rank on every GPU,
    sharing theirs (``launch.single_machine_gpus``, the rule ``oolong train`` follows too; it
    refuses what NCCL or the GPU count cannot do, named here as a placement error)."""
    try:
        trainer, servers = single_machine_gpus(spec, inventory.head.gpus)
    except ValueError as exc:
        raise PlacementError(str(exc)) from None
    return Placement((TrainerSlot(0, 0, trainer),),
                     tuple(ServerSlot(i, 0, gpus, spec.rollout.tp) for i, gpus in enumerate(servers)))


def _plan_on(spec: RunSpec, inventory: NodeInventory, available: list[int]) -> Placement:
    if not available:
        raise PlacementError("no node is online to place the run on")
    wanted = spec.orchestration.placement
    servers = [available.index(i) for i in wanted.server_nodes or [] if i in available] or None
    sub_spec = spec.model_copy(update={"orchestration": spec.orchestration.model_copy(update={
        "placement": wanted.model_copy(update={"server_nodes": servers})})})
    sub = plan(sub_spec, NodeInventory([inventory.nodes[i] for i in available], inventory.meta))
    return Placement(tuple(replace(t, node=available[t.node]) for t in sub.trainers),
                     tuple(replace(s, node=available[s.node]) for s in sub.servers))


def _place_servers(count: int, tp: int, pool: list[int], free: list[list[int]],
                   declared: list[int]) -> list[ServerSlot]:
    servers: list[ServerSlot] = []
    turn = 0
    for i in range(count):
        for step in range(len(pool)):
            node = pool[(turn + step) % len(pool)]
            if not declared[node]:
                # a node without GPUs takes any number of servers (CPU: no device to own)
                servers.append(ServerSlot(i, node, (), tp))
                break
            if len(free[node]) >= tp:
                servers.append(ServerSlot(i, node, tuple(free[node][:tp]), tp))
                del free[node][:tp]
                break
        else:
            have = {node_queue(nd): len(free[nd]) for nd in dict.fromkeys(pool)}
            raise PlacementError(
                f"rollout.num_servers={count} with rollout.tp={tp} needs {count * tp} GPUs on "
                f"the server nodes; server {i} finds no node with {tp} free GPU(s) (free: {have}): "
                "lower rollout.num_servers or rollout.tp, or add GPU nodes to "
                "orchestration.placement.server_nodes")
        turn += 1
    return servers


def _gpu_list(gpus: tuple[int, ...]) -> str:
    return ",".join(map(str, gpus))


def _on(gpus: tuple[int, ...], tp: int) -> str:
    return f": tp {tp}, GPUs {_gpu_list(gpus)}" if gpus else ""
