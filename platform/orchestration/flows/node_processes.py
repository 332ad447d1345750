"""The flows a node's Prefect worker runs for a placed run: one long-running process each.

- ``rollout-server``: one rollout server bound to this node's address, announced to the
  ``training-run`` flow through a Prefect variable once healthy.
- ``trainer``: this node's trainer launcher (``torch.distributed.run``, one per node, with one
  rank per GPU given to training; rank 0 on the first trainer node owns the rollout side).
- ``warm-start``: the spec's supervised warm start, on the first trainer node, before anything
  else starts; the model goes to the durable store, and every node fetches it from there.

Each node prepares its own run directory from the web app over HTTP with the run's credential
(spec, data, reward code) and the run's store (the model the spec names, checked against the
manifest hash the flow passes; the warm-started model): nothing is shared between nodes but the
network. The credential and the web app's URL arrive sealed with the run's node key
(``sealed``, see sealing.py): Prefect shows every flow run's parameters to every client, and the
nodes of other runs are clients too. A flow returns when its
process exits (a failure raises, naming the node); cancelling the flow run stops its process
group first: on the worker's SIGTERM, or when the flow's own read of its state sees the cancel.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext
from prefect.exceptions import MissingContextError
from prefect.states import Cancelled
from prefect.variables import Variable

from orchestration.launchers import warm_start
from orchestration.model_delivery import fetch_model
from orchestration.sealing import NODE, NODE_KEY_ENV, RunCredential, key_from_env
from orchestration.trigger import flow_run_dir
from training_core.checkpoint_store import STORE_ENV, CheckpointStore
from training_core.config import RunSpec, dump_spec
from training_core.launch import (
    check_nccl,
    run_env,
    server_command,
    server_env,
    server_mem_fraction,
    server_process,
    trainer_command,
)
from training_core.models.paths import run_model_dir
from training_core.ports import NODE_ADDRESS_ENV, free_port
from training_core.processes import ManagedProcess
from training_core.remote_run import prepare_remote_run
from training_core.transport.server_auth import derive_server_key


def node_address() -> str:
    return os.environ.get(NODE_ADDRESS_ENV, "127.0.0.1")


def server_variable(run_id: int, index: int) -> str:
    """Where a placed server announces its URL (Prefect variable names: lowercase, underscores)."""
    return f"oolong_run_{run_id}_server_{index}"


def master_variable(run_id: int) -> str:
    """Where the first trainer node announces its rendezvous address."""
    return f"oolong_run_{run_id}_trainer_master"


def wait_variable(name: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (value := Variable.get(name)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing announced at Prefect variable {name!r} in {timeout_s:.0f}s")
        time.sleep(0.5)
    return str(value)


def _store(run_dir: Path, what: str = "model.warm_start_seconds across nodes") -> CheckpointStore:
    store = CheckpointStore.from_env(run_dir)
    if store is None:
        raise RuntimeError(f"{what} needs the durable store: set {STORE_ENV} on every node (a "
                           "folder or an fsspec URL all of them reach)")
    return store


def node_credential(run_id: int, sealed: str) -> RunCredential:
    """The run's credential, opened with this node's key (``OOLONG_NODE_KEY``)."""
    return RunCredential.unseal(key_from_env(NODE_KEY_ENV), sealed, purpose=NODE, run_id=run_id)


def prepare_node_run(run_id: int, sealed: str, run_dir: Path, model_sha256: str = "", *,
                     warm_started: bool = True) -> tuple[RunSpec, Path]:
    """This node's run directory: spec, data and reward code from the web app, the run's model
    from its store (``model_sha256``: the manifest hash the flow published; empty: the node
    resolves ``model.path`` itself), and, with ``warm_started``, the warm-started model when the
    spec has a warm start."""
    cred = node_credential(run_id, sealed)
    spec, spec_path = prepare_remote_run(cred.tracker_url, cred.token, run_dir)
    if model_sha256:
        store = _store(run_dir, "the run's model")
        model = fetch_model(store.url, run_dir.resolve().name, run_dir / "model", model_sha256)
        spec.model.path = str(model)  # every process of this node starts from the delivered one
        dump_spec(spec, spec_path)
    initial = run_dir / "initial_model"
    if warm_started and spec.model.warm_start_seconds > 0 and \
            not (initial / "config.json").exists():
        store = _store(run_dir)
        if not store.has_initial_model():
            raise RuntimeError(f"no warm-started model in the store ({store.url}) on "
                               f"{node_address()}: the warm-start flow run did not finish")
        store.download_initial_model(initial)
    return spec, spec_path


# How often a node's flow reads its own flow run's state. Prefect's worker learns of a cancel
# from an event stream, which lags when the API server is busy (or polls every 10 s when the
# stream is down); this read bounds how long a cancelled run's processes outlive the cancel.
CANCEL_POLL_S = 3.0


def _flow_run_cancelling() -> bool:
    """This flow run is being cancelled, by its state in Prefect's API (False outside a flow run
    and while the API does not answer: Prefect's own path still stops the flow then)."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return False
    try:
        state = ctx.client.read_flow_run(ctx.flow_run.id).state  # the engine's open client
    except Exception:  # noqa: BLE001 - a busy API is asked again at the next poll
        return False
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)


def _mark_cancelled(message: str) -> None:
    """Cancelled in the API and in the engine's own copy of the state. The exit that follows is
    a crash to Prefect's engine unless its copy is already final, and a crash is forced over
    any state: the run would read Crashed, which a supervisor takes for a failure to recover."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    try:
        result = ctx.client.set_flow_run_state(ctx.flow_run.id, Cancelled(message=message),
                                               force=True)
        ctx.flow_run.state = result.state
    except Exception:  # noqa: BLE001 - the process is stopped; the worker's cancel still ends the run
        _logger().warning("could not mark this flow run cancelled", exc_info=True)


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:  # called outside a flow run
        return logging.getLogger(__name__)


def _run_until_exit(proc: ManagedProcess, what: str, *,
                    cancelling: Callable[[], bool] = _flow_run_cancelling,
                    poll_s: float = CANCEL_POLL_S) -> None:
    """Hold the flow while ``proc`` runs. Its process group is stopped first when this flow run
    is cancelled: on SIGTERM (the worker cancelling it), or when a read of the flow run's own
    state says so first."""

    stopping = False

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        if stopping:  # the worker's SIGTERM for the cancel this flow already acts on: one stop
            return
        proc.stop(grace_s=10.0)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    next_read = time.monotonic() + poll_s
    try:
        while proc.alive():
            time.sleep(min(0.5, poll_s))
            if time.monotonic() < next_read:
                continue
            if cancelling():
                stopping = True
                _logger().info("%s: this flow run is being cancelled; stopping it", what)
                proc.stop(grace_s=10.0)
                _mark_cancelled(f"cancelled: {what} on {node_address()} stopped")
                sys.exit(143)
            next_read = time.monotonic() + poll_s
    finally:
        proc.stop(grace_s=10.0)
    code = proc.poll()
    if code != 0:
        raise RuntimeError(f"{what} on {node_address()} exited with {code}:\n{proc.log_tail(1500)}")


@flow(name="rollout-server")
def rollout_server(run_id: int, sealed: str, index: int, gpus: list[int] | None = None,
                   health_timeout_s: float = 300.0, port: int | None = None,
                   model_sha256: str = "") -> None:
    """Rollout server ``index`` on the GPUs the placement plan gave it (``gpus``, this node's
    indices; none on a node without GPUs); ``port``: the one a replaced server had (the trainer
    knows its URL), else any free one of the node's range."""
    logger = get_run_logger()
    run_dir = flow_run_dir(run_id)
    spec, _ = prepare_node_run(run_id, sealed, run_dir, model_sha256)
    host, port = node_address(), port or free_port()
    url = f"http://{host}:{port}"
    model_dir = str(run_model_dir(spec, run_dir))
    check_nccl(spec)
    # A placed server never shares a GPU with a trainer rank (the plan gives disjoint GPUs).
    # every node derives the run's key from the credential it opened: no key travels
    key = derive_server_key(node_credential(run_id, sealed).token)
    cmd = server_command(spec, model_dir, port, index, host=host, parent_pid=os.getpid(),
                         mem_fraction=server_mem_fraction(spec, model_dir, shares_trainer_gpu=False),
                         run_dir=run_dir, server_key=key)
    proc = server_process(f"rollout server {index}", cmd, url,
                          run_dir / "logs" / f"rollout-server-{index}.log",
                          server_env(spec, run_dir, run_id, gpus, server_key=key)).start()
    proc.wait_healthy(health_timeout_s)
    Variable.set(server_variable(run_id, index), url, overwrite=True)
    logger.info("rollout server %d serving at %s", index, url)
    _run_until_exit(proc, f"rollout server {index}")


@flow(name="trainer")
def trainer_node(run_id: int, sealed: str, node_rank: int, nnodes: int, server_urls: list[str],
                 resume: bool = False, gpus: list[int] | None = None,
                 rendezvous_timeout_s: float = 300.0, model_sha256: str = "") -> None:
    """This node's trainer ranks: one per GPU the placement plan gave to training (``gpus``),
    one on a node without GPUs."""
    run_dir = flow_run_dir(run_id)
    _, spec_path = prepare_node_run(run_id, sealed, run_dir, model_sha256)
    if node_rank == 0:  # the first trainer node hosts the rendezvous on a port free here
        master_address, master_port = node_address(), free_port()
        Variable.set(master_variable(run_id), f"{master_address}:{master_port}", overwrite=True)
    else:
        master_address, _, port = wait_variable(master_variable(run_id),
                                                rendezvous_timeout_s).rpartition(":")
        master_port = int(port)
    # A resume on fresh nodes finds its checkpoint in the durable store (OOLONG_CHECKPOINT_STORE).
    cmd = trainer_command(spec_path, server_urls, run_dir, nproc=max(len(gpus or ()), 1),
                          nnodes=nnodes, node_rank=node_rank, master=(master_address, master_port),
                          resume=resume, overrides=("weight_sync=distributed",))
    proc = ManagedProcess(f"trainer node {node_rank}", cmd, run_dir / "logs" / "trainer.log",
                          env=run_env(run_dir, run_id, gpus,
                                      server_key=derive_server_key(
                                          node_credential(run_id, sealed).token))).start()
    _run_until_exit(proc, f"trainer node {node_rank}")


@flow(name="warm-start")
def warm_start_node(run_id: int, sealed: str, model_sha256: str = "") -> None:
    """The warm start of a placed run, made once and kept in the durable store (a resumed run,
    on these nodes or fresh ones, finds it there and does not make it again)."""
    logger = get_run_logger()
    run_dir = flow_run_dir(run_id)
    store = _store(run_dir)
    if store.has_initial_model():
        logger.info("the warm-started model is already in the store")
        return
    spec, spec_path = prepare_node_run(run_id, sealed, run_dir, model_sha256, warm_started=False)
    out = warm_start(spec, spec_path, run_dir, run_id)
    store.upload_initial_model(out)
    logger.info("warm-started model on %s uploaded to %s", node_address(), store.url)
