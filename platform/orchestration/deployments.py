"""Register the node deployments a placed run uses, in the process work pool its nodes serve:
``rollout-server/<pool>``, ``trainer/<pool>`` and ``warm-start/<pool>`` (flows/node_processes.py).
Each node's worker serves its own queue of that pool (``node-<index>``), so a flow run lands on
the node its queue names. The training-run flow calls this before placing (idempotent); by hand:

    PREFECT_API_URL=... python -m orchestration.deployments --pool oolong-nodes

The deployments name the flows by the installed package's module path
(``orchestration.flows.node_processes.trainer_node``), with no pull step and no path: a node runs
whatever ``oolong`` its worker's Python has installed, never a directory of the control machine
(nodes install the package elsewhere, and share no disk with it).
"""

from __future__ import annotations

import argparse


def node_deployments(pool: str) -> list:
    """The three node deployments, by module path (see the module's docstring)."""
    from prefect.deployments.runner import EntrypointType

    from orchestration.flows.node_processes import rollout_server, trainer_node, warm_start_node

    return [flow.to_deployment(name=pool, work_pool_name=pool,
                               entrypoint_type=EntrypointType.MODULE_PATH)
            for flow in (rollout_server, trainer_node, warm_start_node)]


def deploy_node_flows(pool: str) -> list[str]:
    """Create or update the deployments (idempotent); returns ``<flow>/<pool>`` names."""
    names = []
    for deployment in node_deployments(pool):
        # apply, not Flow.deploy: deploy's "no worker online yet" hint fails against Prefect
        # 3.8.8's server (a 422 on its worker filter) before any worker starts.
        deployment.apply(work_pool_name=pool)
        names.append(f"{deployment.flow_name}/{pool}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", required=True, help="the process work pool the nodes' workers serve")
    args = parser.parse_args(argv)
    for name in deploy_node_flows(args.pool):
        print(f"deployed {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
