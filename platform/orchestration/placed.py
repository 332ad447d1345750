"""A run across nodes: every long-running process is a Prefect flow run of a node deployment
(``rollout-server/<pool>``, ``trainer/<pool>``, see flows/node_processes.py and deployments.py)
on the queue of the node that runs it, ``node-<index>``, in the pool the run's nodes serve.
Watched and cancelled through Prefect's API; the ``training-run`` flow decides.

Placement: the trainer on the first ``orchestration.placement.trainer_nodes`` nodes (one
launcher each, rank 0 on the first), the servers round-robin on ``server_nodes`` (default: the
other nodes, or all of them when the trainer uses every node).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Cancelling
from prefect.variables import Variable

from orchestration.flows.node_processes import master_variable, server_variable, wait_variable
from orchestration.providers.base import NodeInventory, node_queue
from orchestration.supervise import Outcome
from orchestration.tracker import Tracker
from training_core.config import RunSpec
from training_core.http import wait_healthy

POOL_ENV = "OOLONG_NODE_POOL"  # the pool static nodes' workers serve
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@dataclass
class Placement:
    trainer_nodes: list[int]
    server_nodes: list[int]  # one entry per server


def plan(spec: RunSpec, inventory: NodeInventory) -> Placement:
    n = len(inventory.nodes)
    wanted = spec.orchestration.placement
    if wanted.trainer_nodes > n:
        raise ValueError(f"orchestration.placement.trainer_nodes is {wanted.trainer_nodes} but "
                         f"the provider gave {n} node(s)")
    trainers = list(range(wanted.trainer_nodes))
    pool = wanted.server_nodes or [i for i in range(n) if i not in trainers] or list(range(n))
    bad = [i for i in pool if not 0 <= i < n]
    if bad:
        raise ValueError(f"orchestration.placement.server_nodes {bad}: nodes are 0..{n - 1}")
    servers = [pool[i % len(pool)] for i in range(spec.rollout.num_servers)]
    return Placement(trainers, servers)


@dataclass(frozen=True)
class PlacedProcess:
    what: str  # "rollout server 1 on node-2"
    node: int
    flow_run_id: UUID


def node_pool(run_id: int, inventory: NodeInventory) -> str:
    """The process work pool the run's nodes serve: Terraform's per-run pool
    (``oolong-run-<id>``, see infra/terraform/run), else ``$OOLONG_NODE_POOL``."""
    if inventory.meta.get("provider") == "terraform":
        return f"oolong-run-{run_id}"
    return os.environ.get(POOL_ENV, "oolong-nodes")


@dataclass
class PlacedRun:
    run_id: int
    tracker_url: str
    ingest_token: str
    spec: RunSpec
    inventory: NodeInventory
    placement: Placement
    pool: str
    servers: list[PlacedProcess] = field(default_factory=list)
    trainers: list[PlacedProcess] = field(default_factory=list)
    jobs: list[PlacedProcess] = field(default_factory=list)  # run to completion first (warm start)
    urls: list[str] = field(default_factory=list)

    def _variables(self) -> list[str]:
        return [master_variable(self.run_id),
                *(server_variable(self.run_id, i) for i in range(len(self.placement.server_nodes)))]

    def _place(self, deployment: str, node: int, what: str, **parameters) -> PlacedProcess:
        run = run_deployment(
            deployment, timeout=0, work_queue_name=node_queue(node), as_subflow=False,
            parameters={"run_id": self.run_id, "tracker_url": self.tracker_url,
                        "ingest_token": self.ingest_token, **parameters},
            flow_run_name=f"run-{self.run_id}-{what.replace(' ', '-')}")
        return PlacedProcess(f"{what} on {node_queue(node)}", node, run.id)

    def warm_start(self, cancelled: Callable[[], bool], *, poll_s: float = 2.0) -> bool:
        """The spec's warm start on the first trainer node; every node fetches the model from
        the durable store. False when the run was cancelled meanwhile; raises when it failed."""
        node = self.placement.trainer_nodes[0]
        job = self._place(f"warm-start/{self.pool}", node, "warm start")
        self.jobs.append(job)
        # Its own time plus the node's start-up, dataset download and the model upload.
        deadline = time.monotonic() + self.spec.model.warm_start_seconds + 600.0
        while (state := self._state(job))[0] != "COMPLETED":
            if state[0] in TERMINAL:
                raise RuntimeError(f"{job.what} ended: {state[0]} {state[1]}".strip())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job.what} did not finish in time")
            if cancelled():
                return False
            time.sleep(poll_s)
        return True

    def start_servers(self, timeout_s: float = 600.0) -> list[str]:
        for name in self._variables():  # a previous attempt's announcements mean nothing now
            Variable.unset(name)
        for i, node in enumerate(self.placement.server_nodes):
            self.servers.append(self._place(f"rollout-server/{self.pool}", node,
                                            f"rollout server {i}", index=i))
        urls = self.urls
        deadline = time.monotonic() + timeout_s
        for i, server in enumerate(self.servers):
            url = self._announced(server_variable(self.run_id, i), server, deadline)
            wait_healthy(url + "/health", max(deadline - time.monotonic(), 1.0))
            urls.append(url)
        return urls

    def _announced(self, variable: str, process: PlacedProcess, deadline: float) -> str:
        while True:
            try:
                return wait_variable(variable, 2.0)
            except TimeoutError:
                state = self.state(process)
                if state in TERMINAL:
                    raise RuntimeError(f"{process.what} ended ({state}) before serving") from None
                if time.monotonic() > deadline:
                    raise

    def start_trainers(self, urls: list[str], *, resume: bool = False) -> None:
        nnodes = len(self.placement.trainer_nodes)
        for rank, node in enumerate(self.placement.trainer_nodes):
            self.trainers.append(self._place(
                f"trainer/{self.pool}", node, f"trainer node {rank}", node_rank=rank, nnodes=nnodes,
                server_urls=urls, resume=resume))

    def _state(self, process: PlacedProcess) -> tuple[str, str]:
        """The flow run's state type and its message, from one read."""
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(process.flow_run_id)
        return (run.state.type.value, run.state.message or "") if run.state else ("PENDING", "")

    def state(self, process: PlacedProcess) -> str:
        return self._state(process)[0]

    def supervise(self, tracker: Tracker, *, poll_s: float = 2.0) -> Outcome:
        """Until the trainers finish, one of the run's processes ends early, a server stops
        answering for ``orchestration.heartbeat_timeout_s`` (a node that died takes its worker
        with it, and nobody reports its flow runs' end), or a cancel."""
        timeout = self.spec.orchestration.heartbeat_timeout_s
        last_seen = [time.monotonic()] * len(self.urls)
        unread = object()
        first_step = last_step = unread  # first_step: where this attempt started (a resume's)
        progressed = time.monotonic()
        while True:
            now = time.monotonic()
            for i, url in enumerate(self.urls):
                if _model_info(url) is not None:
                    last_seen[i] = now
                elif now - last_seen[i] > timeout:
                    return Outcome("failed", f"{self.servers[i].what} ({url}) has not answered "
                                             f"for {timeout:.0f}s: the node is gone or unreachable")
            states = {p: self._state(p) for p in self.trainers + self.servers}
            if all(states[p][0] == "COMPLETED" for p in self.trainers):
                return Outcome("succeeded")
            for p, (state, message) in states.items():
                if state in TERMINAL and not (p in self.trainers and state == "COMPLETED"):
                    return Outcome("failed", f"{p.what} ended: {state} {message}".strip())
            try:
                info = tracker.run_info()
            except Exception:  # noqa: BLE001 - the web app may be restarting; ask again
                info = {}
            if info.get("cancel_requested"):
                return Outcome("cancelled", "cancelled by user")
            # A trainer node that dies reports nothing either: once this attempt's steps come,
            # they must keep coming (before its first one, startup time, a resumed run's
            # checkpoint download included, is the flow runs' own business).
            if info:
                step = info.get("last_step")
                if first_step is unread:
                    first_step = step
                if step != last_step:
                    last_step, progressed = step, now
                elif step != first_step and now - progressed > timeout:
                    return Outcome("failed", f"the trainer ({', '.join(p.what for p in self.trainers)}) "
                                             f"made no progress for {timeout:.0f}s")
            time.sleep(poll_s)

    def server_versions(self) -> list[str]:
        """Each server's ``weight_version`` (``/model_info``); "?" where it does not answer."""
        return [str((_model_info(url) or {}).get("weight_version", "?")) for url in self.urls]

    def stop(self, timeout_s: float = 30.0) -> list[str]:
        """Cancel every placed flow run (each node's worker stops its process); returns what
        did not reach a final state in time."""
        pending = [p for p in self.jobs + self.trainers + self.servers
                   if self.state(p) not in TERMINAL]
        with get_client(sync_client=True) as client:
            for p in pending:
                client.set_flow_run_state(p.flow_run_id, Cancelling(), force=True)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            time.sleep(1.0)
            pending = [p for p in pending if self.state(p) not in TERMINAL]
        for name in self._variables():
            Variable.unset(name)
        return [p.what for p in pending]


def _model_info(url: str) -> dict | None:
    """A server's ``/model_info``, None when it does not answer. Not /health: SGLang's health
    check generates a token and fails while generation is paused for a weight push."""
    try:
        resp = httpx.get(url + "/model_info", timeout=5.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:  # it answers, without a version to report
        return {}
