"""The Terraform path, shown by simulation: two cloud GPU nodes booted from the cloud-init the
gpu_node_pool module renders (rendered by Terraform itself), a real Prefect server as the control
plane's, and a short training run placed on them.

Each node is its own loopback address (127.0.0.2, 127.0.0.3), its own directory (its "disk") and
its own venv, into which the rendered ``pip install`` commands install a wheel of this project
built by the test: nothing of the checkout is shared with a node. The work pool does not exist
when the run starts: the nodes' workers create it, as on a fresh cloud pool, and the flow waits
for them. How the simulation stays honest, and the few things it cannot do here (the metadata
service, apt, systemd, the ubuntu user), is in ``cloud_sim.py``'s docstring.

One shortcut, for time and disk: the node venvs see this machine's third-party distributions
(torch, DeepSpeed, Prefect...) through a ``.pth`` line instead of downloading them
(``cloud_sim.dependency_dir``); the rendered ``pip install`` lines run as written and find them
satisfied, and pip writes no console script for them, so the test writes Prefect's (the
unit's ExecStart runs it). Oolong itself is installed from the wheel into each node's venv; the
test asserts that the node's Python imports it from there, and that every process of the run on
a node runs that venv's Python, outside the checkout, with no PYTHONPATH into it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.integration import cloud_sim
from tests.integration.conftest import (
    ROOT,
    create_run,
    run_status,
    wait_for,
    wait_for_exit,
)
from tests.integration.prefect_cluster import kill, start_server
from training_core.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multinode]
POOL = "oolong-cloud-sim"
NODES = ["127.0.0.2", "127.0.0.3"]
PORT_RANGE = "41000-41499"  # the security group's server_port_range, here
# Each node declares two GPUs to Ray (its oolong-ray unit's --num-gpus), as a g5.12xlarge would
# declare four: Ray places by them and sets CUDA_VISIBLE_DEVICES, which this CPU ignores.
GPUS = 2
# This machine's, not the node's: no GPU (DeepSpeed's CPU accelerator, one thread per process)
# and no model hub. A GPU node with network needs none of them.
MACHINE_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
# A node's package index, as behind a mirror: this machine's offline copy, when it has one.
MIRROR = Path("/opt/pypi/simple")



def _dpkg_installed(package: str) -> bool:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True,
                         text=True)
    return out.returncode == 0 and out.stdout.endswith("installed")


@pytest.fixture
def cloud(tmp_path, monkeypatch):
    """A Prefect server, then two nodes booted from their rendered cloud-init, each with its
    worker started as its systemd unit; the environment the web app's stack passes on
    (PREFECT_API_URL, the nodes, the pool) is set for the training-run flow."""
    procs: list[subprocess.Popen] = []
    store = tmp_path / "checkpoint-store"
    nodes: list[cloud_sim.SimulatedNode] = []
    try:
        api, _ = start_server(tmp_path, "oolong_prefect_cloud_sim", procs)
        wheel = cloud_sim.build_wheel(tmp_path / "wheel")
        deps = cloud_sim.dependency_dir(tmp_path / "machine-dependencies")
        pip_env = {"PIP_INDEX_URL": MIRROR.as_uri()} if MIRROR.is_dir() else {}
        ray_port, ray_client_port = free_port(), free_port()
        for i, address in enumerate(NODES):
            node = cloud_sim.SimulatedNode(i, address, tmp_path / f"node-{i}")
            rendered = cloud_sim.render_cloud_init(
                {"oolong_package": f"{wheel}[core,orchestration]", "sglang_version": "",
                 "prefect_api_url": api, "work_pool": POOL, "node_index": i,
                 "port_range": PORT_RANGE, "checkpoint_store": store.as_uri(),
                 "runs_dir": str(node.root / "runs"), "gpus": GPUS, "ray_head_address": NODES[0],
                 "ray_port": ray_port, "ray_client_port": ray_client_port},
                tmp_path / f"console-{i}")
            with cloud_sim.FakeIMDS(address) as imds:
                # the venv exists once `python3.11 -m venv` ran: the dependency link goes in
                # before the pip lines (a pre-baked image's packages, in effect)
                node.boot(rendered, imds.url, pip_env,
                          after_venv=lambda n=node: cloud_sim.link_dependencies(n.venv, deps))
            cloud_sim.console_script(node.venv, "prefect", "prefect.cli", "app")
            cloud_sim.console_script(node.venv, "ray", "ray.scripts.scripts", "main")
            nodes.append(node)
        # The Ray units: node 0 heads the cluster (its unit must be up before the others join:
        # on a cloud node systemd restarts a unit that found no head yet).
        for node in nodes:
            procs.append(node.start_unit("oolong-ray.service", MACHINE_ENV))
            wait_for(lambda n=node: "ray runtime started" in (
                n.root / "oolong-ray.log").read_text().lower(), 120, f"Ray on node-{node.index}")
        for node in nodes:
            procs.append(node.start_worker(MACHINE_ENV))
        for node in nodes:
            wait_for(lambda n=node: "started" in (
                n.root / "oolong-prefect-worker.log").read_text().lower(), 120,
                     f"the worker of node-{node.index}")
        monkeypatch.setenv("PREFECT_API_URL", api)
        # the run module's ray_address output (Ray Client on node 0), as the provider reads it
        monkeypatch.setenv("OOLONG_RAY_ADDRESS", f"ray://{NODES[0]}:{ray_client_port}")
        monkeypatch.setenv("OOLONG_STATIC_NODES", ",".join(NODES))
        monkeypatch.setenv("OOLONG_NODE_POOL", POOL)
        yield {"api": api, "nodes": nodes, "procs": procs, "store": store, "wheel": wheel,
               "workers": procs[-len(nodes):]}
    finally:
        for worker in procs[1:]:  # a failed test may leave flow runs below a node's worker
            for pid in cloud_sim.descendants(worker.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in reversed(procs):
            kill(proc)


def test_fake_imds_speaks_imdsv2():
    """The stand-in refuses what the real service refuses: no token, a bad TTL."""
    import httpx

    with cloud_sim.FakeIMDS("127.0.0.2") as imds:
        meta = imds.url + "/latest/meta-data/local-ipv4"
        assert httpx.get(meta).status_code == 401
        assert httpx.put(imds.url + "/latest/api/token").status_code == 400
        token = httpx.put(imds.url + "/latest/api/token",
                          headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}).text
        assert httpx.get(meta, headers={"X-aws-ec2-metadata-token": "forged"}).status_code == 401
        answer = httpx.get(meta, headers={"X-aws-ec2-metadata-token": token})
        assert answer.status_code == 200 and answer.text == "127.0.0.2"


def test_a_run_on_two_nodes_booted_from_terraforms_cloud_init(cloud, stack, admin):
    from webapp.runs.models import Run, RunEvent

    nodes: list[cloud_sim.SimulatedNode] = cloud["nodes"]
    # What could not run here is exactly what the module docstring names.
    for node in nodes:
        assert [c.split()[0] for c in node.skipped] == ["chown", "systemctl", "systemctl"], \
            node.skipped
        # The node venv's interpreter is the one the package requires (requires-python), not
        # the AMI's python3 (Ubuntu 22.04: 3.10); this machine's python3 would hide that.
        venv_cmd = next(c for c in node.doc["runcmd"] if "-m venv /opt/oolong/venv" in str(c))
        requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
        assert venv_cmd.split()[0] == "python3.11" and ">=3.11,<3.12" == requires, venv_cmd
        assert "python3.11-venv" in node.doc["packages"]
        missing = [p for p in node.doc["packages"] if not _dpkg_installed(p)]
        assert not missing, f"apt packages the node gets but this machine lacks: {missing}"
        env = node.environment_file()
        assert env["OOLONG_NODE_ADDRESS"] == node.address  # from the metadata service
        assert env["OOLONG_RUNS_DIR"] == str(node.root / "runs")
        assert env["OOLONG_CHECKPOINT_STORE"] == cloud["store"].as_uri()
        assert "OOLONG_SGLANG_PYTHON" not in env  # sglang_version="": embedded servers
        # The node's Python imports Oolong from its own venv (the wheel), not from the checkout.
        where = subprocess.run(
            [str(node.venv / "bin" / "python"), "-c",
             "import training_core, orchestration.flows.node_processes as f, prefect;"
             "print(training_core.__file__); print(f.__file__); print(prefect.__file__)"],
            cwd=env["OOLONG_RUNS_DIR"], env={"PATH": cloud_sim.SYSTEM_PATH, **env},
            capture_output=True, text=True, check=True).stdout.split()
        site = str(node.venv / "lib")
        assert where[0].startswith(site) and where[1].startswith(site), where
        assert not where[2].startswith(site)  # the dependencies: this machine's (the shortcut)

    steps = 4
    run_id = create_run(admin, "simulated-cloud", trainer={"steps": steps, "batch_groups": 2},
                        checkpoint={"every": 2, "keep": 2}, rollout={"num_servers": 1},
                        orchestration={"provider": "static",
                                       "placement": {"trainer_nodes": 2, "server_nodes": [1],
                                                     "trainer_gpus_per_node": 1}})
    run_dirs = [n.root / "runs" / "flows" / f"run-{run_id}" for n in nodes]
    wait_for(lambda: all((d / "logs" / "trainer.log").exists() for d in run_dirs), 600,
             "a trainer on each node")
    # Every process below each node's worker: the flow runs and what they started.
    seen = []
    for node, worker in zip(nodes, cloud["workers"], strict=True):
        views = [v for pid in cloud_sim.descendants(worker.pid)
                 if (v := cloud_sim.process_view(pid)) is not None]
        assert any("prefect.engine" in v["cmdline"] for v in views), views
        for v in views:
            if Path(v["argv0"]).name.startswith("python"):  # not a tool a library shells out to
                assert v["argv0"].startswith(str(node.venv)), v
            assert not v["cwd"].startswith(str(ROOT)), v
            assert str(ROOT) not in v["pythonpath"], v
        seen.append(views)
    assert all(seen)
    # The server listens on its node's address (from the metadata service), in the port range.
    server = next(v["cmdline"].split() for v in seen[1] if "rollout_server.server" in v["cmdline"])
    assert server[server.index("--host") + 1] == "127.0.0.3", server
    assert 41000 <= int(server[server.index("--port") + 1]) <= 41499, server

    wait_for(lambda: run_status(run_id) in ("succeeded", "failed", "cancelled"), 600,
             "the run to end")
    run = Run.objects.get(id=run_id)
    events = list(RunEvent.objects.filter(run_id=run_id).order_by("id")
                  .values_list("kind", "message"))
    assert run.status == "succeeded", (run.status_reason, events[-10:])
    # Each process ran on its node, in the runs_dir its cloud-init gave it.
    logs = [{p.name for p in (d / "logs").glob("*.log")} for d in run_dirs]
    assert "trainer.log" in logs[0] and "trainer.log" in logs[1], logs
    assert "rollout-server-0.log" in logs[1] and "rollout-server-0.log" not in logs[0], logs
    # Ray placed it (its cluster joined by the nodes' oolong-ray units): the trainer nodes on
    # distinct nodes, in an order Ray chose; the server on server_nodes=[1].
    placements = RunEvent.objects.filter(run_id=run_id, kind="placement")
    assert len(placements) == 1 and placements[0].message.startswith(
        f"placement plan (by Ray at {os.environ['OOLONG_RAY_ADDRESS']}): "), placements
    plan = placements[0].data["plan"]
    assert sorted(t["node"] for t in plan["trainers"]) == ["node-0", "node-1"], plan
    assert [s["node"] for s in plan["servers"]] == ["node-1"], plan
    # Every process got the GPUs of its bundle, and no two processes on a node share one.
    owned = {t["node"]: {"trainer": t["gpus"]} for t in plan["trainers"]}
    owned["node-1"]["server"] = plan["servers"][0]["gpus"]
    assert set(owned["node-1"]["trainer"]).isdisjoint(owned["node-1"]["server"]), owned
    for node, views in zip(nodes, seen, strict=True):
        want = owned[f"node-{node.index}"]
        for v in views:
            role = ("server" if "rollout_server.server" in v["cmdline"] else
                    "trainer" if "training_core.cli" in v["cmdline"] else None)
            if role:
                assert v["gpus"] == ",".join(map(str, want[role])), (node.index, role, v)
        assert any("training_core.cli" in v["cmdline"] for v in views), views
    # The durable store received the run's checkpoints.
    assert any((cloud["store"] / f"run-{run_id}" / "checkpoints").glob("step*/COMPLETE"))
    wait_for_exit(run_id, 60, "every process of the run to exit")
    for worker in cloud["workers"]:
        wait_for(lambda w=worker: not cloud_sim.descendants(w.pid), 60,
                 "the nodes' flow runs to exit")
