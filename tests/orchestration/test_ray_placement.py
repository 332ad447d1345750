"""Per-GPU placement by Ray, on a real Ray cluster of loopback nodes that declare GPU counts.

A head on 127.0.0.1 (no resources: the control machine) and two nodes, 127.0.0.2 and .3, each with
its own directory, joined the way cloud-init's ``oolong-ray`` unit joins them: ``--num-gpus 8``
and the node's queue as its ``oolong-node`` label. The test connects as the flow does, through
Ray Client (``ray://``). Ray sets ``CUDA_VISIBLE_DEVICES`` for a task in a bundle whatever the
machine has, so what each process would get is checked against what Ray itself set there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from orchestration.placement import PlacementError
from orchestration.providers.base import Node, NodeInventory
from orchestration.ray_placement import NODE_LABEL, PlacementCancelled, reserve

from training_core.config import load_spec
from training_core.launch import run_env, server_command, trainer_command
from training_core.ports import free_port

ray = pytest.importorskip("ray")
RAY = str(Path(sys.executable).with_name("ray"))
NODES = ["127.0.0.2", "127.0.0.3"]


def _start(args: list[str], root: Path, name: str) -> subprocess.Popen:
    # --block: the command stays, and stopping it stops the node's Ray processes with it
    log = (root / f"{name}.log").open("w")
    return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats",
                             "--object-store-memory", "80000000", "--temp-dir",
                             str(root / name), *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
                            start_new_session=True)


def _alive_nodes() -> dict[str, dict]:
    return {(n.get("Labels") or {}).get(NODE_LABEL, "head"): n for n in ray.nodes() if n["Alive"]}


def _until_listening(port: int, head: subprocess.Popen, timeout_s: float = 120) -> None:
    """Wait until the head's GCS accepts connections on ``port`` (polled, not slept on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if head.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head's GCS never listened on {port}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must be short
    gcs, client = free_port(), free_port()
    procs = [_start(["--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
                     "--ray-client-server-port", str(client), "--num-cpus", "0",
                     "--num-gpus", "0", "--include-dashboard", "false"], root, "head")]
    try:
        _until_listening(gcs, procs[0])  # the GCS first: a node that finds none gives up
        for i, address in enumerate(NODES):
            procs.append(_start(["--address", f"127.0.0.1:{gcs}", "--node-ip-address", address,
                                 "--num-cpus", "4", "--num-gpus", "8",
                                 "--labels", f"{NODE_LABEL}=node-{i}"], root, f"node-{i}"))
        address = f"ray://127.0.0.1:{client}"
        deadline = time.monotonic() + 180  # 30 s per node on a loaded 2-core host
        while True:
            try:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
                if {"node-0", "node-1"} <= set(_alive_nodes()):
                    break
                ray.shutdown()
            except ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the loopback Ray cluster did not come up: "
                                   + (root / "node-1.log").read_text()[-2000:])
            time.sleep(1)
        yield address
    finally:
        ray.shutdown()
        for proc in reversed(procs):
            with_group = proc.pid
            try:
                os.killpg(with_group, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(with_group, signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def _inventory(*gpus: int) -> NodeInventory:
    return NodeInventory([Node(f"127.0.0.{i + 2}", g) for i, g in enumerate(gpus)])


def _free_gpus(expect: float | None = None) -> float:
    """The cluster's free GPUs; with ``expect``, once they reach it (a removed group's
    resources come back asynchronously), or what they are after 20 s."""
    deadline = time.monotonic() + 20
    while True:
        free = ray.available_resources().get("GPU", 0.0)
        if expect is None or free == expect or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def _visible(group, bundle: int, gpus: float) -> tuple[str, str]:
    """What Ray itself sets for a process in ``bundle``: its node and CUDA_VISIBLE_DEVICES."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def look() -> tuple[str, str]:
        return (ray.get_runtime_context().get_node_labels()[NODE_LABEL],
                os.environ.get("CUDA_VISIBLE_DEVICES", ""))

    return ray.get(ray.remote(look).options(
        num_cpus=1, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle)).remote())


def test_ray_gives_each_server_its_tp_gpus_and_the_trainer_its_ranks(cluster, tmp_path):
    spec = load_spec(None, ["rollout.num_servers=3", "rollout.tp=2", "rollout.backend=sglang",
                            "orchestration.placement.trainer_gpus_per_node=4"])
    held = reserve(spec, _inventory(8, 8), cluster, timeout_s=30)
    try:
        p = held.placement
        assert [len(s.gpus) for s in p.servers] == [2, 2, 2] and p.trainers[0].nproc == 4
        assert _free_gpus() == 16 - 10  # held while the run lasts
        owned: dict[int, list[int]] = {}
        for slot in [*p.trainers, *p.servers]:
            owned.setdefault(slot.node, []).extend(slot.gpus)
        for node, gpus in owned.items():  # nobody shares a GPU, and each exists on its node
            assert len(gpus) == len(set(gpus)) and set(gpus) <= set(range(8)), (node, gpus)
        trainer_group, server_group = held.groups
        # What each process gets is what Ray set in its bundle: the node and the GPUs.
        trainer = p.trainers[0]
        assert _visible(trainer_group, 0, 4) == (
            f"node-{trainer.node}", run_env(tmp_path, 1, trainer.gpus)["CUDA_VISIBLE_DEVICES"])
        for i, slot in enumerate(p.servers):
            assert _visible(server_group, i, 2) == (
                f"node-{slot.node}", run_env(tmp_path, 1, slot.gpus)["CUDA_VISIBLE_DEVICES"])
            cmd = server_command(spec, "/models/m", 30000 + i, slot.index, host=NODES[slot.node])
            assert cmd[cmd.index("--tp-size") + 1] == "2"
        cmd = trainer_command(tmp_path / "spec.yaml", ["http://a"], tmp_path, nproc=trainer.nproc)
        assert cmd[cmd.index("--nproc_per_node") + 1] == "4"
    finally:
        held.release()
    assert _free_gpus(16) == 16  # released: the next run gets them


def test_trainer_nodes_each_get_a_node_of_their_own(cluster):
    spec = load_spec(None, ["rollout.num_servers=2", "orchestration.placement.trainer_nodes=2",
                            "orchestration.placement.trainer_gpus_per_node=6"])
    held = reserve(spec, _inventory(8, 8), cluster, timeout_s=30)
    try:
        p = held.placement
        assert sorted(t.node for t in p.trainers) == [0, 1]
        assert [t.node_rank for t in p.trainers] == [0, 1]
        assert all(len(t.gpus) == 6 for t in p.trainers)
        # the servers found the two GPUs each trainer node left
        assert sorted(s.node for s in p.servers) == [0, 1]
    finally:
        held.release()


def test_server_nodes_limit_where_servers_go_and_the_trainer_keeps_off_them(cluster):
    """Four servers limited to node-1 need all four of its CPUs: the trainer must not land there
    (placed first, it could: Ray places group by group)."""
    spec = load_spec(None, ["rollout.num_servers=4", "orchestration.placement.server_nodes=[1]",
                            "orchestration.placement.trainer_gpus_per_node=2"])
    for _ in range(3):  # Ray's choice among equal nodes is not fixed: more than one try
        held = reserve(spec, _inventory(8, 8), cluster, timeout_s=30)
        try:
            assert [s.node for s in held.placement.servers] == [1, 1, 1, 1]
            assert [t.node for t in held.placement.trainers] == [0]
        finally:
            held.release()
        _free_gpus(16)


def test_a_run_that_does_not_fit_while_another_holds_the_gpus_is_refused(cluster):
    spec = load_spec(None, ["rollout.num_servers=3", "rollout.tp=2",
                            "orchestration.placement.trainer_gpus_per_node=4"])
    first = reserve(spec, _inventory(8, 8), cluster, timeout_s=30)
    try:
        with pytest.raises(PlacementError, match=r"could not place the rollout servers: 3 "
                                                 r"server\(s\) with 2 GPU\(s\).*free in the whole "
                                                 r"cluster now: 2 GPU"):
            reserve(spec, _inventory(8, 8), cluster, timeout_s=4)
        assert _free_gpus(6) == 6  # the refused run holds nothing
    finally:
        first.release()


def test_a_plan_larger_than_the_nodes_is_refused_before_ray_is_asked(cluster):
    spec = load_spec(None, ["rollout.num_servers=9", "rollout.tp=2",
                            "orchestration.placement.trainer_gpus_per_node=2"])
    with pytest.raises(PlacementError, match=r"rollout.num_servers=9 with rollout.tp=2"):
        reserve(spec, _inventory(8, 8), cluster, timeout_s=30)
    assert _free_gpus(16) == 16


def test_a_node_that_never_joins_is_named(cluster):
    spec = load_spec(None, ["rollout.num_servers=1"])
    with pytest.raises(PlacementError, match=r"\['node-2'\] have not joined the Ray cluster"):
        reserve(spec, _inventory(8, 8, 8), cluster, timeout_s=2)


def test_a_cancel_ends_the_wait_for_nodes_and_for_gpus_holding_nothing(cluster):
    spec = load_spec(None, ["rollout.num_servers=3", "rollout.tp=2",
                            "orchestration.placement.trainer_gpus_per_node=4"])
    with pytest.raises(PlacementCancelled, match=r"node-2"):  # node-2 never joins
        reserve(spec, _inventory(8, 8, 8), cluster, timeout_s=60, cancelled=lambda: True)
    first = reserve(spec, _inventory(8, 8), cluster, timeout_s=30)
    try:
        start = time.monotonic()
        asked = {"n": 0}

        def cancel_soon() -> bool:  # the user presses cancel while Ray waits for GPUs
            asked["n"] += 1
            return asked["n"] > 1
        with pytest.raises(PlacementCancelled, match=r"waiting for GPUs for the rollout servers"):
            reserve(spec, _inventory(8, 8), cluster, timeout_s=60, cancelled=cancel_soon)
        assert time.monotonic() - start < 30  # not the whole timeout
        assert _free_gpus(6) == 6  # the cancelled run holds nothing
    finally:
        first.release()


def test_a_recovery_places_on_the_nodes_alive_in_ray_without_waiting(cluster):
    """node-2 is online to Prefect but not in Ray (its raylet died): the recovery places the
    run on node-0 and node-1 at once instead of waiting out the timeout for node-2."""
    spec = load_spec(None, ["rollout.num_servers=2", "orchestration.placement.trainer_gpus_per_node=4"])
    start = time.monotonic()
    held = reserve(spec, _inventory(8, 8, 8), cluster, timeout_s=120, available=[0, 1, 2])
    try:
        assert time.monotonic() - start < 60
        nodes = {t.node for t in held.placement.trainers} | {s.node for s in held.placement.servers}
        assert nodes <= {0, 1}
    finally:
        held.release()


def test_releasing_never_raises_when_the_session_is_gone(cluster):
    """A teardown after the cluster (or the connection) went away: the groups went with the
    session, and release says nothing failed rather than raising."""
    spec = load_spec(None, ["rollout.num_servers=1"])
    held = reserve(spec, _inventory(8, 8), cluster, timeout_s=30)
    ray.shutdown()  # the session ends: Ray removes its groups
    try:
        assert held.release() == [] and held.groups == []
    finally:
        ray.init(address=cluster, logging_level="ERROR", log_to_driver=False)
    assert _free_gpus(16) == 16


def test_a_connection_that_fails_while_the_head_starts_its_server_is_tried_again(monkeypatch):
    """The Ray client's proxier starts a server per client; on a loaded head that server can die
    while starting (seen in the simulated cloud). ``connect`` tries again after a pause, and
    gives up with the error after CONNECT_ATTEMPTS. ray.init is replaced: a head that fails this
    way on demand cannot be made here, and a real refused connection takes ~30 s to fail."""
    from orchestration import ray_placement

    calls, pauses = [], []
    outcomes = iter([ConnectionError("ray client server died"), None])

    def init(**kwargs):
        calls.append(kwargs["address"])
        failure = next(outcomes)
        if failure is not None:
            raise failure

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_placement.time, "sleep", pauses.append)
    ray_placement.connect("ray://127.0.0.1:1")
    assert calls == ["ray://127.0.0.1:1"] * 2 and pauses == [ray_placement.CONNECT_PAUSE_S]

    calls.clear()
    outcomes = iter([ConnectionError(f"died {i}") for i in range(ray_placement.CONNECT_ATTEMPTS)])
    with pytest.raises(ConnectionError, match=f"died {ray_placement.CONNECT_ATTEMPTS - 1}"):
        ray_placement.connect("ray://127.0.0.1:1")
    assert len(calls) == ray_placement.CONNECT_ATTEMPTS
