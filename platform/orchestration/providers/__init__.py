"""Node providers: where a run's processes go."""

from __future__ import annotations

from orchestration.providers.base import Node, NodeInventory, NodeProvider


def get_provider(name: str, **options) -> NodeProvider:
    if name == "local":
        from orchestration.providers.local import LocalNodeProvider

        return LocalNodeProvider(**options)
    if name == "terraform":
        from orchestration.providers.terraform import TerraformNodeProvider

        return TerraformNodeProvider(**options)
    if name == "static":
        from orchestration.providers.static import StaticNodeProvider

        return StaticNodeProvider(**options)
    raise ValueError(f"unknown node provider {name!r}; use 'local', 'static' or 'terraform'")


__all__ = ["Node", "NodeInventory", "NodeProvider", "get_provider"]
