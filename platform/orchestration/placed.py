"""A run across nodes: every long-running process is a Prefect flow run of a node deployment
(``rollout-server/<pool>``, ``trainer/<pool>``, see flows/node_processes.py and deployments.py)
on the queue of the node that runs it, ``node-<index>``, in the pool the run's nodes serve.
Watched and cancelled through Prefect's API; the ``training-run`` flow decides.

Placement: Ray's placement groups where the run has a Ray cluster (``ray_placement.reserve``:
per GPU, the trainer's ranks per node, each server's GPUs and tensor-parallel size), else
``placement.plan`` for nodes without GPUs; refused before anything starts when it does not fit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import urlsplit
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, WorkQueueFilter
from prefect.client.schemas.sorting import FlowRunSort
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.states import Cancelling
from prefect.variables import Variable

from orchestration.flows.node_processes import master_variable, server_variable, wait_variable
from orchestration.placement import Placement, PlacementError, plan  # noqa: F401 - re-exported
from orchestration.probe import probe
from orchestration.providers.base import NodeInventory, node_queue
from orchestration.ray_placement import Reservation
from orchestration.supervise import Outcome
from orchestration.tracker import Tracker
from training_core.config import RunSpec
from training_core.transport.http import wait_healthy

POOL_ENV = "OOLONG_NODE_POOL"  # the pool static nodes' workers serve
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


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
    # The run's credential and the web app's URL, sealed with the run's node key (sealing.py):
    # the only form in which they appear in a flow run's parameters.
    sealed: str
    spec: RunSpec
    inventory: NodeInventory
    placement: Placement
    pool: str
    servers: list[PlacedProcess] = field(default_factory=list)
    trainers: list[PlacedProcess] = field(default_factory=list)
    jobs: list[PlacedProcess] = field(default_factory=list)  # run to completion first (warm start)
    urls: list[str] = field(default_factory=list)
    reservation: Reservation | None = None  # Ray's hold on the placement's GPUs
    model_sha256: str = ""  # the run's model in its store (model_delivery.py); "": none
    # the servers' key, derived from the nodes' credential as each node derives it (the probes
    # of /model_info need it); never a parameter
    server_key: str = field(default="", repr=False)

    def _variables(self) -> list[str]:
        return [master_variable(self.run_id),
                *(server_variable(self.run_id, i) for i in range(len(self.placement.server_nodes)))]

    def _place(self, deployment: str, node: int, what: str, **parameters) -> PlacedProcess:
        run = run_deployment(
            deployment, timeout=0, work_queue_name=node_queue(node), as_subflow=False,
            parameters={"run_id": self.run_id, "sealed": self.sealed,
                        "model_sha256": self.model_sha256, **parameters},
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
        for slot in self.placement.servers:
            self.servers.append(self._place_server(slot.index))
        urls = self.urls
        deadline = time.monotonic() + timeout_s
        for i, server in enumerate(self.servers):
            url = self._announced(server_variable(self.run_id, i), server, deadline)
            wait_healthy(url + "/health", max(deadline - time.monotonic(), 1.0))
            urls.append(url)
        return urls

    def _place_server(self, index: int, port: int | None = None) -> PlacedProcess:
        slot = self.placement.servers[index]
        return self._place(f"rollout-server/{self.pool}", slot.node, f"rollout server {index}",
                           index=index, gpus=list(slot.gpus), port=port)

    def replace_server(self, index: int, timeout_s: float = 300.0) -> str:
        """Server ``index`` exited while its node lives on: a new one on the same node and GPUs
        (its Ray bundle still holds them), at the same URL, so the trainer, which waits for a
        restarting server within its retry window, finds it there; its next weight push sees
        the launch ``weight_version``, rebuilds the group and brings it to the current one.
        Returns the URL; raises when it cannot serve there in time."""
        old = self.urls[index]
        Variable.unset(server_variable(self.run_id, index))
        process = self._place_server(index, port=urlsplit(old).port)
        self.servers[index] = process
        deadline = time.monotonic() + timeout_s
        url = self._announced(server_variable(self.run_id, index), process, deadline)
        if url != old:
            raise RuntimeError(f"{process.what} came back at {url}, not {old}")
        wait_healthy(url + "/health", max(deadline - time.monotonic(), 1.0))
        return url

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
        nnodes = len(self.placement.trainers)
        for slot in self.placement.trainers:
            self.trainers.append(self._place(
                f"trainer/{self.pool}", slot.node, f"trainer node {slot.node_rank}",
                node_rank=slot.node_rank, nnodes=nnodes, server_urls=urls, resume=resume,
                gpus=list(slot.gpus)))

    def _state(self, process: PlacedProcess) -> tuple[str, str]:
        """The flow run's state type and its message, from one read."""
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(process.flow_run_id)
        return (run.state.type.value, run.state.message or "") if run.state else ("PENDING", "")

    def state(self, process: PlacedProcess) -> str:
        return self._state(process)[0]

    def _states(self, processes: list[PlacedProcess]) -> dict[PlacedProcess, tuple[str, str]]:
        """Every process's flow-run state in one API call (not one per process: at 64 nodes
        that was the poll's cost)."""
        if not processes:
            return {}
        with get_client(sync_client=True) as client:
            # sort given: Prefect 3.8.8's server refuses the client's null sort (422)
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[p.flow_run_id for p in processes])),
                sort=FlowRunSort.ID_DESC, limit=len(processes))
        by_id = {r.id: r for r in runs}
        out = {}
        for p in processes:
            run = by_id.get(p.flow_run_id)
            out[p] = ((run.state.type.value, run.state.message or "") if run and run.state
                      else ("PENDING", ""))
        return out

    def supervise(self, tracker: Tracker, *, poll_s: float = 2.0) -> Outcome:
        """Until the trainers finish, one of the run's processes ends early, a server stops
        answering for ``orchestration.heartbeat_timeout_s`` (a node that died takes its worker
        with it, and nobody reports its flow runs' end), or a cancel. A server whose process
        exited on a live node is replaced in place, up to ``orchestration.max_server_restarts``
        times in the attempt."""
        orch = self.spec.orchestration
        timeout = orch.heartbeat_timeout_s
        lost_after = min(orch.server_lost_after_s, timeout)
        last_seen = [time.monotonic()] * len(self.urls)
        used = sorted({p.node for p in self.trainers + self.servers})
        replaced = 0  # servers replaced in place (orchestration.max_server_restarts)
        unread = object()
        first_step = last_step = unread  # first_step: where this attempt started (a resume's)
        progressed = time.monotonic()
        while True:
            # every server at once, bounded by the probe timeout (not one after another)
            answers = probe(self.urls, timeout_s=orch.probe_timeout_s,
                            api_key=self.server_key or None).infos
            now = time.monotonic()
            for i, (url, info) in enumerate(zip(self.urls, answers, strict=True)):
                if info is not None:
                    last_seen[i] = now
                elif now - last_seen[i] > lost_after:
                    return Outcome("failed", f"{self.servers[i].what} ({url}) has not answered "
                                             f"for {lost_after:.0f}s: the node is gone or "
                                             "unreachable", recoverable=True,
                                   lost_nodes=(self.servers[i].node,))
            # A node that died took its worker along: its queue is no longer polled.
            ages = queue_ages(self.pool)
            for node in used:
                age = ages.get(node_queue(node))
                if age is not None and age > orch.worker_lost_after_s:
                    what = ", ".join(p.what for p in self.trainers + self.servers
                                     if p.node == node)
                    return Outcome("failed", f"{node_queue(node)} lost ({what}): its worker has "
                                             f"not polled for {age:.0f}s", recoverable=True,
                                   lost_nodes=(node,))
            states = self._states(self.trainers + self.servers)
            if all(states[p][0] == "COMPLETED" for p in self.trainers):
                return Outcome("succeeded")
            for p in self.trainers:  # a trainer's end is decided before any server is replaced
                state, message = states[p]
                if state in TERMINAL and state != "COMPLETED":
                    return Outcome("failed", f"{p.what} ended: {state} {message}".strip(),
                                   recoverable=state in {"FAILED", "CRASHED"})
            for i, p in enumerate(self.servers):
                state, message = states[p]
                if state not in TERMINAL:
                    continue
                detail = f"{p.what} ended: {state} {message}".strip()
                # its process exited and its node's worker said so: that node lives on
                if state not in {"FAILED", "CRASHED"} or replaced >= orch.max_server_restarts:
                    return Outcome("failed", detail, recoverable=state in {"FAILED", "CRASHED"})
                replaced += 1
                detail = detail.splitlines()[0]
                try:
                    url = self.replace_server(i)
                except Exception as exc:  # noqa: BLE001 - the whole run recovers instead
                    return Outcome("failed", f"{detail}; replacing it failed: {exc}",
                                   recoverable=True)
                tracker.event("recovery", f"{detail}; replaced in place at {url} "
                                          f"({replaced}/{orch.max_server_restarts}): the "
                                          "trainer re-admits it at its next weight push",
                              server=i, url=url)
                # the loop stood still while the new server came up: every clock restarts
                last_seen = [time.monotonic()] * len(self.urls)
                progressed = time.monotonic()
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
                                             f"made no progress for {timeout:.0f}s",
                                   recoverable=True)
            time.sleep(poll_s)

    def server_versions(self) -> list[str]:
        """Each server's ``weight_version`` (``/model_info``); "?" where it does not answer."""
        infos = probe(self.urls, timeout_s=self.spec.orchestration.probe_timeout_s,
                      api_key=self.server_key or None).infos
        return [str((info or {}).get("weight_version", "?")) for info in infos]

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
        # never raises: the teardown goes on; what it could not remove is reported with the rest
        released = self.reservation.release() if self.reservation is not None else []
        return [p.what for p in pending] + released

    def reset(self, placement: Placement, reservation: Reservation | None = None) -> None:
        """A fresh attempt on another placement (after ``stop``): nothing placed yet."""
        self.placement, self.reservation = placement, reservation
        self.servers, self.trainers, self.jobs, self.urls = [], [], [], []


def queue_ages(pool: str) -> dict[str, float | None]:
    """Seconds since each queue of ``pool`` was last polled by a worker (None: never), in one
    API call; empty while the pool does not exist (no worker has created it yet)."""
    with get_client(sync_client=True) as client:
        try:
            # every argument given: Prefect 3.8.8's server refuses the client's nulls (422)
            queues = client.read_work_queues(work_pool_name=pool,
                                             work_queue_filter=WorkQueueFilter(), limit=200,
                                             offset=0)
        except ObjectNotFound:
            return {}
    now = datetime.now(UTC)
    return {q.name: (now - q.last_polled).total_seconds() if q.last_polled else None
            for q in queues}


def online_nodes(pool: str, count: int, fresh_s: float) -> list[int]:
    """The nodes (of ``count``) whose worker polled its queue within ``fresh_s``."""
    ages = queue_ages(pool)
    return [i for i in range(count)
            if (age := ages.get(node_queue(i))) is not None and age <= fresh_s]


def wait_nodes_online(pool: str, nodes: list[int], *, timeout_s: float, fresh_s: float,
                      cancelled: Callable[[], bool] = lambda: False, poll_s: float = 2.0) -> bool:
    """Until every node in ``nodes`` has a worker polling its queue (cloud nodes come up minutes
    after ``terraform apply``, and their worker creates the pool). False when cancelled
    meanwhile; raises, naming the missing nodes, after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        _ensure_queues(pool, [node_queue(i) for i in nodes])
        online = set(online_nodes(pool, max(nodes, default=-1) + 1, fresh_s))
        missing = [node_queue(i) for i in nodes if i not in online]
        if not missing:
            return True
        if cancelled():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"nodes {missing} have no worker online in work pool {pool!r} after "
                f"{timeout_s:.0f}s (orchestration.nodes_online_timeout_s): start their workers "
                f"(prefect worker start --pool {pool} --work-queue <node>) or read their setup "
                "log (cloud-init: /var/log/cloud-init-output.log)")
        time.sleep(poll_s)


def _ensure_queues(pool: str, names: list[str]) -> None:
    """Create the nodes' queues in ``pool`` once it exists (a worker polling a queue that does
    not exist gets a 404 and never marks it polled). Nothing while the pool does not exist."""
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.create_work_queue(name=name, work_pool_name=pool)
            except ObjectAlreadyExists:
                continue
            except ObjectNotFound:  # no pool yet: its first worker creates it
                return
