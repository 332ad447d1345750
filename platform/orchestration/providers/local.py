"""This machine as the only node (CPU, or its GPUs when it has them)."""

from __future__ import annotations

from orchestration.providers.base import Node, NodeInventory


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


class LocalNodeProvider:
    name = "local"

    def provision(self, run_id: int, spec: dict) -> NodeInventory:
        return NodeInventory([Node(address="127.0.0.1", gpus=_local_gpus())], meta={"provider": "local"})

    def release(self, run_id: int) -> None:
        pass  # nothing was created

    def store_url(self, spec: dict) -> str | None:
        return None  # the run directory is durable: nothing travels

    def node_key(self, run_id: int) -> str:
        raise RuntimeError("the local provider places nothing on nodes")
