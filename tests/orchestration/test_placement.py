"""Which node runs what: the placement plan from the run spec and the provider's nodes."""

from __future__ import annotations

import pytest
from orchestration.placed import plan
from orchestration.providers.base import Node, NodeInventory, node_queue
from orchestration.providers.static import StaticNodeProvider

from training_core.config import load_spec


def _nodes(n: int) -> NodeInventory:
    return NodeInventory([Node(address=f"127.0.0.{i + 2}") for i in range(n)])


def test_default_trainer_on_the_first_node_servers_on_the_rest():
    spec = load_spec(None, ["rollout.num_servers=4"])
    p = plan(spec, _nodes(3))
    assert p.trainer_nodes == [0]
    assert p.server_nodes == [1, 2, 1, 2]


def test_explicit_nodes_and_a_trainer_that_uses_every_node():
    spec = load_spec(None, ["rollout.num_servers=3", "orchestration.placement.trainer_nodes=2"])
    assert plan(spec, _nodes(2)).server_nodes == [0, 1, 0]  # no node left: servers share them
    spec = load_spec(None, ["rollout.num_servers=2", "orchestration.placement.trainer_nodes=2",
                            "orchestration.placement.server_nodes=[1, 2]"])
    p = plan(spec, _nodes(3))
    assert p.trainer_nodes == [0, 1] and p.server_nodes == [1, 2]
    assert [node_queue(n) for n in p.server_nodes] == ["node-1", "node-2"]


def test_impossible_placements_name_the_field():
    with pytest.raises(ValueError, match="placement.trainer_nodes is 3 but the provider gave 2"):
        plan(load_spec(None, ["orchestration.placement.trainer_nodes=3"]), _nodes(2))
    with pytest.raises(ValueError, match=r"placement.server_nodes \[5\]: nodes are 0..1"):
        plan(load_spec(None, ["orchestration.placement.server_nodes=[5]"]), _nodes(2))


def test_static_provider_reads_the_deployments_node_list():
    inv = StaticNodeProvider("10.0.0.5:8, 10.0.0.6:8").provision(7, {})
    assert [(n.address, n.gpus) for n in inv.nodes] == [("10.0.0.5", 8), ("10.0.0.6", 8)]
    with pytest.raises(RuntimeError, match="OOLONG_STATIC_NODES"):
        StaticNodeProvider("").provision(7, {})


class _Tracker:
    """The web app's answers about the run: its last trained step, as a trainer reports."""

    def __init__(self, steps):
        self.steps = steps  # a function of the seconds since the start

    def run_info(self) -> dict:
        import time

        return {"last_step": self.steps(time.monotonic() - self.start)}


def _supervised(monkeypatch, steps, timeout_s: float):
    import time
    from uuid import uuid4

    from orchestration.placed import PlacedProcess, PlacedRun, Placement
    from orchestration.placement import TrainerSlot

    spec = load_spec(None, [f"orchestration.heartbeat_timeout_s={timeout_s}"])
    run = PlacedRun(1, "sealed", spec, _nodes(2), Placement((TrainerSlot(0, 0, ()),), ()), "pool")
    run.trainers = [PlacedProcess("trainer node 0 on node-0", 0, uuid4())]
    monkeypatch.setattr(PlacedRun, "_states", lambda self, ps: {p: ("RUNNING", "") for p in ps})
    monkeypatch.setattr("orchestration.placed.queue_ages", lambda pool: {})  # workers: polling
    tracker = _Tracker(steps)
    tracker.start = time.monotonic()
    outcome = run.supervise(tracker, poll_s=0.02)
    return outcome, time.monotonic() - tracker.start


def test_a_resumed_trainer_may_start_slowly_but_then_must_keep_stepping(monkeypatch):
    """A resumed run's tracker already has the last attempt's steps: the progress clock starts
    at this attempt's first new step, not at the old ones (a slow checkpoint download on a
    fresh node once failed a resume as 'made no progress')."""
    outcome, took = _supervised(monkeypatch, lambda t: 7 if t < 1.0 else 8, timeout_s=0.3)
    assert outcome.status == "failed" and "made no progress for 0s" in outcome.reason
    assert "trainer node 0 on node-0" in outcome.reason
    assert 1.2 <= took < 3.0, took  # not at 0.3 s on the old step 7; 0.3 s after step 8


def test_a_fresh_trainer_that_stops_stepping_fails_the_run(monkeypatch):
    outcome, took = _supervised(monkeypatch, lambda t: None if t < 0.5 else (1 if t < 0.7 else 2),
                                timeout_s=0.3)
    assert outcome.status == "failed" and took >= 0.9


# ---- per-GPU placement: nodes that declare their GPU counts ----------------------------------

def _gpu_nodes(*gpus: int) -> NodeInventory:
    return NodeInventory([Node(address=f"127.0.0.{i + 2}", gpus=g) for i, g in enumerate(gpus)])


def _launch(spec, placement, tmp_path, monkeypatch):
    """What each placed process is started with: argv and environment, built by the one
    launcher exactly as the node flows build them."""
    from training_core.launch import run_env, server_command, trainer_command

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nnodes = len(placement.trainers)
    out = {}
    for s in placement.servers:
        out[f"server {s.index}"] = (server_command(spec, "/m", 30000 + s.index, s.index,
                                                   host=f"127.0.0.{s.node + 2}"),
                                    run_env(tmp_path, 7, s.gpus))
    for t in placement.trainers:
        out[f"trainer {t.node_rank}"] = (
            trainer_command(tmp_path / "spec.yaml", ["http://x:1"], tmp_path, nproc=t.nproc,
                            nnodes=nnodes, node_rank=t.node_rank, master=("127.0.0.2", 29500)),
            run_env(tmp_path, 7, t.gpus))
    return out


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_servers_own_tp_gpus_each_and_the_trainer_the_node(tmp_path, monkeypatch):
    spec = load_spec(None, ["rollout.backend=sglang", "rollout.num_servers=4", "rollout.tp=2"])
    p = plan(spec, _gpu_nodes(8, 8))
    assert [(s.node, s.gpus) for s in p.servers] == [(1, (0, 1)), (1, (2, 3)), (1, (4, 5)),
                                                      (1, (6, 7))]
    procs = _launch(spec, p, tmp_path, monkeypatch)
    for i in range(4):
        cmd, env = procs[f"server {i}"]
        assert _arg(cmd, "--tp-size") == "2" and _arg(cmd, "--host") == "127.0.0.3"
        assert env["CUDA_VISIBLE_DEVICES"] == f"{2 * i},{2 * i + 1}"
        assert env["OOLONG_RUN_ID"] == "7"
    cmd, env = procs["trainer 0"]
    assert _arg(cmd, "--nproc_per_node") == "8" and "--standalone" in cmd
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert p.bundles().count({"CPU": 1.0, "GPU": 1.0}) == 8
    assert p.bundles()[8:] == [{"CPU": 1.0, "GPU": 2.0}] * 4


def test_eight_by_eight_uses_every_gpu(tmp_path, monkeypatch):
    spec = load_spec(None, ["rollout.backend=sglang", "rollout.num_servers=16", "rollout.tp=2",
                            "orchestration.placement.trainer_nodes=4"])
    p = plan(spec, _gpu_nodes(*[8] * 8))
    used = {(t.node, g) for t in p.trainers for g in t.gpus} | {
        (s.node, g) for s in p.servers for g in s.gpus}
    assert len(used) == 64  # nothing owned twice, nothing idle
    assert [t.nproc for t in p.trainers] == [8, 8, 8, 8]
    assert sorted({s.node for s in p.servers}) == [4, 5, 6, 7]
    procs = _launch(spec, p, tmp_path, monkeypatch)
    for rank in range(4):
        cmd, _ = procs[f"trainer {rank}"]
        assert (_arg(cmd, "--nnodes"), _arg(cmd, "--node_rank"), _arg(cmd, "--nproc_per_node")) \
            == ("4", str(rank), "8")


def test_servers_and_trainer_share_a_node_without_sharing_a_gpu(tmp_path, monkeypatch):
    spec = load_spec(None, ["rollout.backend=sglang", "rollout.num_servers=2", "rollout.tp=2"])
    p = plan(spec, _gpu_nodes(8))
    assert [s.gpus for s in p.servers] == [(0, 1), (2, 3)]
    assert p.trainers[0].gpus == (4, 5, 6, 7)
    procs = _launch(spec, p, tmp_path, monkeypatch)
    assert _arg(procs["trainer 0"][0], "--nproc_per_node") == "4"
    assert procs["trainer 0"][1]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    spec = load_spec(None, ["rollout.num_servers=2", "rollout.tp=2",
                            "orchestration.placement.trainer_gpus_per_node=2"])
    assert plan(spec, _gpu_nodes(8)).trainers[0].gpus == (4, 5)


def test_nodes_without_gpus_run_one_rank_and_any_servers(tmp_path, monkeypatch):
    spec = load_spec(None, ["rollout.num_servers=3"])
    p = plan(spec, _gpu_nodes(0, 0))
    assert [(s.node, s.gpus) for s in p.servers] == [(1, ()), (1, ()), (1, ())]
    procs = _launch(spec, p, tmp_path, monkeypatch)
    cmd, env = procs["trainer 0"]
    assert cmd[1:3] == ["-m", "training_core.cli"]  # one process: no launcher
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert all("CUDA_VISIBLE_DEVICES" not in env for cmd, env in procs.values())


def test_plans_that_do_not_fit_are_refused_naming_what_is_missing():
    from orchestration.placement import PlacementError

    spec = load_spec(None, ["rollout.num_servers=3", "rollout.tp=4"])
    with pytest.raises(PlacementError, match=r"rollout.num_servers=3 with rollout.tp=4 needs 12 "
                                             r"GPUs.*server 2 .*'node-1': 0"):
        plan(spec, _gpu_nodes(8, 8))
    spec = load_spec(None, ["rollout.num_servers=2", "rollout.tp=2"])
    with pytest.raises(PlacementError, match=r"trainer node 0 \(node-0\).*has 0 free of 4 \(4 "
                                             r"owned by rollout servers\)"):
        plan(spec, _gpu_nodes(4))
    spec = load_spec(None, ["orchestration.placement.trainer_gpus_per_node=16"])
    with pytest.raises(PlacementError, match="needs 16 GPU.*trainer_gpus_per_node"):
        plan(spec, _gpu_nodes(8, 8))
    with pytest.raises(PlacementError, match=r"nodes \['node-1'\] declare no GPU"):
        plan(load_spec(None, []), _gpu_nodes(8, 0))
    spec = load_spec(None, ["orchestration.placement.trainer_nodes=2",
                            "orchestration.placement.server_nodes=[0]", "rollout.tp=2"])
    with pytest.raises(PlacementError, match=r"\[6, 8\] ranks each.*trainer_gpus_per_node"):
        plan(spec, _gpu_nodes(8, 8))


def test_the_plan_for_the_run_page():
    spec = load_spec(None, ["rollout.num_servers=1", "rollout.tp=2"])
    p = plan(spec, StaticNodeProvider("127.0.0.2:2,127.0.0.3:2").provision(7, {}))
    assert p.as_dict() == {
        "trainers": [{"node": "node-0", "node_rank": 0, "nproc_per_node": 2, "gpus": [0, 1]}],
        "servers": [{"index": 0, "node": "node-1", "tp": 2, "gpus": [0, 1]}]}
    assert p.describe() == ["trainer node 0 on node-0: 2 rank(s), GPUs 0,1",
                            "rollout server 0 on node-1: tp 2, GPUs 0,1"]


def test_a_recovery_plans_on_the_nodes_still_online():
    spec = load_spec(None, ["rollout.num_servers=2", "orchestration.placement.server_nodes=[1, 2]"])
    inventory = _gpu_nodes(2, 2, 2)
    p = plan(spec, inventory, available=[1, 2])  # node-0 (the trainer's) was lost
    assert [(s.node, s.gpus) for s in p.servers] == [(1, (0,)), (2, (0,))]
    assert p.trainer_nodes == [1] and p.trainers[0].gpus == (1,)  # node-1's GPU the server left
    p = plan(spec, inventory, available=[0, 1])  # node-2 (a server's) was lost
    assert p.trainer_nodes == [0] and [(s.node, s.gpus) for s in p.servers] == [(1, (0,)), (1, (1,))]
    from orchestration.placement import PlacementError

    with pytest.raises(PlacementError, match="no node is online"):
        plan(spec, inventory, available=[])


def test_one_machine_that_cannot_split_its_gpus_shares_them():
    from orchestration.placement import PlacementError, shared_plan

    spec = load_spec(None, ["rollout.num_servers=1"])
    with pytest.raises(PlacementError):
        plan(spec, _gpu_nodes(1))  # the server would take the only GPU
    p = shared_plan(spec, _gpu_nodes(1))
    assert p.trainers[0].gpus == (0,) and [s.gpus for s in p.servers] == [(0,)]
    assert p.shares_trainer_gpu(p.servers[0])


def test_a_shared_plan_gives_each_server_gpus_of_its_own():
    """Servers share GPUs with the trainer, never with each other: two servers on two GPUs were
    both stacked on GPU 0 (each saw every GPU and took the first)."""
    from orchestration.placement import shared_plan

    p = shared_plan(load_spec(None, ["rollout.num_servers=2"]), _gpu_nodes(2))
    assert [s.gpus for s in p.servers] == [(0,), (1,)]
    assert p.trainers[0].gpus == (0, 1)
    p = shared_plan(load_spec(None, ["rollout.num_servers=2", "rollout.tp=2"]), _gpu_nodes(4))
    assert [s.gpus for s in p.servers] == [(0, 1), (2, 3)]
    # a machine without GPUs: nobody owns one
    p = shared_plan(load_spec(None, ["rollout.num_servers=3"]), _gpu_nodes(0))
    assert [s.gpus for s in p.servers] == [(), (), ()] and not p.shares_trainer_gpu(p.servers[0])


def test_a_shared_plan_refuses_what_the_gpus_or_nccl_cannot_do():
    from orchestration.placement import PlacementError, shared_plan

    with pytest.raises(PlacementError, match=r"needs 4 GPUs and this machine has 2"):
        shared_plan(load_spec(None, ["rollout.num_servers=2", "rollout.tp=2"]), _gpu_nodes(2))
    # trainer rank 0 and server 0 would be two ranks of one NCCL group on GPU 0
    with pytest.raises(PlacementError, match=r"weight_sync=distributed.*NCCL refuses.*"
                                             r"weight_sync=disk"):
        shared_plan(load_spec(None, ["weight_sync=distributed"]), _gpu_nodes(1))
