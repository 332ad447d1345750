"""Nodes someone already runs (bring your own machines): each runs a Prefect worker serving its
queue, ``node-<index>``, in the run's work pool. The list is deployment configuration:
``OOLONG_STATIC_NODES=10.0.0.5:8,10.0.0.6:8`` (address, optionally ``:gpus``), in queue order."""

from __future__ import annotations

import os

from orchestration.providers.base import Node, NodeInventory

NODES_ENV = "OOLONG_STATIC_NODES"


class StaticNodeProvider:
    name = "static"

    def __init__(self, nodes: str | None = None):
        self.nodes = nodes if nodes is not None else os.environ.get(NODES_ENV, "")

    def provision(self, run_id: int, spec: dict) -> NodeInventory:
        nodes = []
        for item in filter(None, (s.strip() for s in self.nodes.split(","))):
            address, _, gpus = item.partition(":")
            nodes.append(Node(address=address, gpus=int(gpus or 0)))
        if not nodes:
            raise RuntimeError(f"provider 'static' needs {NODES_ENV} (comma-separated node "
                               "addresses, each running a Prefect worker on queue node-<index>)")
        return NodeInventory(nodes, meta={"provider": "static"})

    def release(self, run_id: int) -> None:
        pass  # the nodes are not ours to destroy
