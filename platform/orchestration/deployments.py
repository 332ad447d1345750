"""Register the node deployments a placed run uses, in the process work pool its nodes serve:
``rollout-server/<pool>``, ``trainer/<pool>`` and ``warm-start/<pool>`` (flows/node_processes.py). Each node's worker
serves its own queue of that pool (``node-<index>``), so a flow run lands on the node its queue
names. The training-run flow calls this before placing (idempotent); by hand:

    PREFECT_API_URL=... python -m orchestration.deployments --pool oolong-nodes
"""

from __future__ import annotations

import argparse
from pathlib import Path

PLATFORM = Path(__file__).resolve().parents[1]
ROOT = PLATFORM.parent
NODE_FLOWS = [  # flow names: rollout-server, trainer, warm-start
    "orchestration/flows/node_processes.py:rollout_server",
    "orchestration/flows/node_processes.py:trainer_node",
    "orchestration/flows/node_processes.py:warm_start_node",
]


def deploy_node_flows(pool: str, *, code_dir: Path = ROOT) -> list[str]:
    """Create or update the deployments; the flow code is read from ``code_dir`` on each node
    (the same install everywhere; run directories are per node, ``OOLONG_RUNS_DIR``)."""
    from prefect import Flow

    names = []
    for entrypoint in NODE_FLOWS:
        flow = Flow.from_source(source=str(code_dir / "platform"), entrypoint=entrypoint)
        # to_deployment + apply: Flow.deploy's "no worker online yet" hint fails against
        # Prefect 3.8.8's server (a 422 on its worker filter) before any worker starts.
        flow.to_deployment(
            name=pool, work_pool_name=pool,
            job_variables={"env": {"PYTHONPATH": f"{code_dir}:{code_dir / 'platform'}"}},
        ).apply(work_pool_name=pool)
        names.append(f"{flow.name}/{pool}")
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
