"""Nodes someone already runs (bring your own machines): each runs a Prefect worker serving its
queue, ``node-<index>``, in the run's work pool. The list is deployment configuration:
``OOLONG_STATIC_NODES=10.0.0.5:8,10.0.0.6:8`` (address, optionally ``:gpus``), in queue order.

So are the store the nodes and the flows' worker share (``OOLONG_CHECKPOINT_STORE``: the model
reaches the nodes through it) and the deployment's node key (``OOLONG_NODE_KEY``, on the flows'
worker and every node: static nodes serve every run placed on them, so they share one key)."""

from __future__ import annotations

import os

from orchestration.providers.base import Node, NodeInventory
from orchestration.sealing import NODE_KEY_ENV, key_from_env
from training_core.checkpoint_store import STORE_ENV

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

    def store_url(self, spec: dict) -> str | None:
        return os.environ.get(STORE_ENV, "").strip() or None

    def node_key(self, run_id: int) -> str:
        return key_from_env(NODE_KEY_ENV)
