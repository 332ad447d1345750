from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


def node_queue(index: int) -> str:
    """The Prefect work queue a node's worker serves (cloud-init starts it with this name)."""
    return f"node-{index}"


def node_index(queue: str) -> int | None:
    """The node a queue name (or a Ray node's oolong-node label) names; None for any other."""
    prefix, _, number = queue.partition("-")
    return int(number) if prefix == "node" and number.isdecimal() else None


@dataclass(frozen=True)
class Node:
    address: str
    gpus: int = 0
    ssh_user: str | None = None
    private_address: str | None = None


@dataclass
class NodeInventory:
    nodes: list[Node]
    meta: dict = field(default_factory=dict)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def hostfile(self) -> str:
        """DeepSpeed's hostfile: one `host slots=N` line per node."""
        return "".join(f"{n.private_address or n.address} slots={max(n.gpus, 1)}\n" for n in self.nodes)


class NodeProvider(Protocol):
    name: str

    def provision(self, run_id: int, spec: dict) -> NodeInventory: ...

    def release(self, run_id: int) -> None: ...

    def store_url(self, spec: dict) -> str | None:
        """The run's store as the nodes reach it (the build, the model, checkpoints); None:
        none."""
        ...

    def node_key(self, run_id: int) -> str:
        """The key the run's nodes open their sealed credentials with (sealing.py)."""
        ...
