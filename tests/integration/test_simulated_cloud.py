"""The Terraform path, shown by simulation with the production defaults: a cloud GPU node booted
from the cloud-init the gpu_node_pool module renders (rendered by Terraform itself), a real
Prefect server as the control plane's (authenticated, as production requires), and a one-node
run placed on it.

The node is its own loopback address (127.0.0.2), its own directory (its "disk") and its own
venv. What the Terraform provider does before ``apply`` is done here with the same function: the
exact build (this tree's wheel and its pins) is published in the run's store by hash
(``orchestration.builds.publish_build``), and cloud-init fetches it from there, checks every
hash and installs the wheel file: nothing of the checkout is shared with the node, and nothing is
installed by name. The run's node key and the Prefect credential reach the node through its
cloud-init, as on Terraform nodes. The run itself is placed although it has one node (any
provider but ``local`` places), its model comes from the run's store, checked against the hash
the flow published, and afterwards no token, key or credential shows in any flow run's
parameters, Prefect log, Prefect event, run event or log file; while it runs, a node of another
run (another node key) reading every flow run through Prefect's API gets nothing it can use.
How the simulation stays honest, and the few things it cannot do here (the metadata service,
apt, systemd, the ubuntu user, the GPU pins), is in ``cloud_sim.py``'s docstring.

One shortcut, for time and disk: the node venv sees this machine's third-party distributions
(torch, DeepSpeed, Prefect...) through a ``.pth`` line instead of downloading them
(``cloud_sim.dependency_dir``); the rendered ``pip install`` lines run as written and find them
satisfied, and pip writes no console script for them, so the test writes Prefect's and Ray's
(the units' ExecStart run them). Oolong itself is installed from the published wheel into the
node's venv; the test asserts that the node's Python imports it from there, and that every
process of the run on the node runs that venv's Python, outside the checkout, with no
PYTHONPATH into it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
from pathlib import Path

import httpx
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
NODE = "127.0.0.2"
PORT_RANGE = "41000-41499"  # the security group's server_port_range, here
# The node declares two GPUs to Ray (its oolong-ray unit's --num-gpus), as a g5.12xlarge would
# declare four: Ray places by them and sets CUDA_VISIBLE_DEVICES, which this CPU ignores.
GPUS = 2
# This machine's, not the node's: no GPU (DeepSpeed's CPU accelerator, one thread per process)
# and no model hub. A GPU node with network needs none of them.
# The embedded server's C++ kernels neither: a GPU node runs SGLang, and building them for the
# node's own cache took minutes of this shared machine.
MACHINE_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "OOLONG_CPU_KERNELS": "0"}
# A node's package index, as behind a mirror: this machine's offline copy, when it has one.
MIRROR = Path("/opt/pypi/simple")
TOKEN_LIKE = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(32), the runs' tokens


def _dpkg_installed(package: str) -> bool:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True,
                         text=True)
    return out.returncode == 0 and out.stdout.endswith("installed")


@pytest.fixture
def cloud(tmp_path, monkeypatch):
    """A Prefect server that requires authentication, the run's build published in its store,
    then a node booted from its rendered cloud-init, with its Ray head and its worker started as
    their systemd units; the environment the web app's stack passes on (the Prefect API and its
    credential, the node, the pool, the store, the deployment's node key) is set for the flow."""
    from orchestration.builds import publish_build
    from orchestration.sealing import new_key

    procs: list[subprocess.Popen] = []
    store = tmp_path / "checkpoint-store"
    auth = "oolong:" + secrets.token_urlsafe(24)
    node_key = new_key()
    node = cloud_sim.SimulatedNode(0, NODE, tmp_path / "node-0")
    try:
        api, _ = start_server(tmp_path, "oolong_prefect_cloud_sim", procs, auth=auth)
        # What the Terraform provider publishes before apply (CPU pins here: cloud_sim.py).
        build = publish_build(store.as_uri(), gpu=False)
        deps = cloud_sim.dependency_dir(tmp_path / "machine-dependencies")
        pip_env = {"PIP_INDEX_URL": MIRROR.as_uri()} if MIRROR.is_dir() else {}
        ray_port, ray_client_port = free_port(), free_port()
        rendered = cloud_sim.render_cloud_init(
            {"oolong_build": build, "sglang_version": "", "prefect_api_url": api,
             "prefect_api_auth_string": auth, "node_key": node_key, "efa": False,
             "work_pool": POOL, "node_index": 0, "port_range": PORT_RANGE,
             "checkpoint_store": store.as_uri(), "runs_dir": str(node.root / "runs"),
             "gpus": GPUS, "ray_head_address": NODE, "ray_port": ray_port,
             "ray_client_port": ray_client_port},
            tmp_path / "console")
        with cloud_sim.FakeIMDS(NODE) as imds:
            # the venv exists once `python3.11 -m venv` ran: the dependency link goes in before
            # the pip lines (a pre-baked image's packages, in effect)
            node.boot(rendered, imds.url, pip_env,
                      after_venv=lambda: cloud_sim.link_dependencies(node.venv, deps))
        cloud_sim.console_script(node.venv, "prefect", "prefect.cli", "app")
        cloud_sim.console_script(node.venv, "ray", "ray.scripts.scripts", "main")
        # The Ray unit first (the node heads its run's cluster), then the worker.
        procs.append(node.start_unit("oolong-ray.service", MACHINE_ENV))
        wait_for(lambda: "ray runtime started" in (
            node.root / "oolong-ray.log").read_text().lower(), 120, "Ray on node-0")
        procs.append(node.start_worker(MACHINE_ENV))
        wait_for(lambda: "started" in (node.root / "oolong-prefect-worker.log").read_text().lower(),
                 120, "the worker of node-0")
        monkeypatch.setenv("PREFECT_API_URL", api)
        monkeypatch.setenv("PREFECT_API_AUTH_STRING", auth)
        # the run module's ray_address output (Ray Client on node 0), as the provider reads it
        monkeypatch.setenv("OOLONG_RAY_ADDRESS", f"ray://{NODE}:{ray_client_port}")
        monkeypatch.setenv("OOLONG_STATIC_NODES", NODE)
        monkeypatch.setenv("OOLONG_NODE_POOL", POOL)
        monkeypatch.setenv("OOLONG_NODE_KEY", node_key)
        monkeypatch.setenv("OOLONG_CHECKPOINT_STORE", store.as_uri())
        yield {"api": api, "auth": auth, "node": node, "procs": procs, "store": store,
               "build": build, "node_key": node_key, "worker": procs[-1]}
    finally:
        for worker in procs[1:]:  # a failed test may leave flow runs below the node's worker
            for pid in cloud_sim.descendants(worker.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in reversed(procs):
            kill(proc)


def test_fake_imds_speaks_imdsv2():
    """The stand-in refuses what the real service refuses: no token, a bad TTL."""
    with cloud_sim.FakeIMDS("127.0.0.2") as imds:
        meta = imds.url + "/latest/meta-data/local-ipv4"
        assert httpx.get(meta).status_code == 401
        assert httpx.put(imds.url + "/latest/api/token").status_code == 400
        token = httpx.put(imds.url + "/latest/api/token",
                          headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}).text
        assert httpx.get(meta, headers={"X-aws-ec2-metadata-token": "forged"}).status_code == 401
        answer = httpx.get(meta, headers={"X-aws-ec2-metadata-token": token})
        assert answer.status_code == 200 and answer.text == "127.0.0.2"


def _prefect(cloud: dict, path: str, body: dict | None = None, *, auth: bool = True) -> httpx.Response:
    headers = {"Authorization": "Basic " + base64.b64encode(cloud["auth"].encode()).decode()}
    return httpx.post(cloud["api"] + path, json=body or {}, headers=headers if auth else {},
                      timeout=30)


def _flow_runs(cloud: dict) -> list[dict]:
    runs = _prefect(cloud, "/flow_runs/filter", {"limit": 200, "sort": "ID_DESC"})
    assert runs.status_code == 200, runs.text
    return runs.json()


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _another_runs_node_reads_prefect(cloud: dict, run_id: int, web: str) -> None:
    """A node of another run holds the Prefect credential (its worker polls the API) and its
    own run's node key: every flow run's parameters are readable, and none of them is of use.
    Without the credential the API answers nothing."""
    from orchestration.sealing import NODE as PURPOSE
    from orchestration.sealing import RunCredential, SealError, new_key

    assert _prefect(cloud, "/flow_runs/filter", auth=False).status_code == 401
    placed = [r for r in _flow_runs(cloud) if r["name"].startswith(f"run-{run_id}-")]
    assert placed, "the run's placed flow runs"
    other_key = new_key()
    for flow_run in placed:
        params = flow_run["parameters"]
        with pytest.raises(SealError):
            RunCredential.unseal(other_key, params["sealed"], purpose=PURPOSE, run_id=run_id)
        for candidate in _strings(params):
            for path in ("/api/ingest/run/", f"/api/runs/{run_id}/"):
                got = httpx.get(web + path, headers={"Authorization": f"Bearer {candidate}"},
                                timeout=30)
                assert got.status_code in (401, 403), (path, got.status_code)


def _no_secret_anywhere(cloud: dict, run_id: int, texts: list[str]) -> None:
    """No run token (found by its hash among every token-shaped string), node key or Prefect
    credential in ``texts``."""
    from webapp.runs.models import RunToken

    hashes = set(RunToken.objects.filter(run_id=run_id).values_list("token_hash", flat=True))
    assert len(hashes) >= 2  # the flow's and its nodes'
    for text in texts:
        assert cloud["node_key"] not in text and cloud["auth"] not in text
        assert cloud["auth"].split(":", 1)[1] not in text
        leaked = [s for s in TOKEN_LIKE.findall(text)
                  if hashlib.sha256(s.encode()).hexdigest() in hashes]
        assert not leaked, text[:300]


def test_a_one_node_run_booted_from_terraforms_cloud_init(cloud, stack, admin):
    from webapp.runs.models import Run, RunEvent

    node: cloud_sim.SimulatedNode = cloud["node"]
    # What could not run here is exactly what the module docstring names.
    assert [c.split()[0] for c in node.skipped] == ["chown", "systemctl", "systemctl"], \
        node.skipped
    # The node's venv is made with the Python the package requires, not the AMI's python3
    # (tests/infra/test_node_install.py checks every environment against what it installs).
    assert "python3.11 -m venv /opt/oolong/venv" in node.doc["runcmd"]
    assert "python3.11-venv" in node.doc["packages"]
    missing = [p for p in node.doc["packages"] if not _dpkg_installed(p)]
    assert not missing, f"apt packages the node gets but this machine lacks: {missing}"
    # The exact build, from the store, every hash checked before pip ran.
    log = (node.root / "cloud-init-output.log").read_text()
    for f in cloud["build"].values():
        name = Path(f["url"]).name
        fetched = node.root / "opt" / "oolong" / "dist" / name
        assert hashlib.sha256(fetched.read_bytes()).hexdigest() == f["sha256"], name
        assert f"{name}: OK" in log
    env = node.environment_file()
    assert env["OOLONG_NODE_ADDRESS"] == node.address  # from the metadata service
    assert env["OOLONG_RUNS_DIR"] == str(node.root / "runs")
    assert env["OOLONG_CHECKPOINT_STORE"] == cloud["store"].as_uri()
    assert env["OOLONG_NODE_KEY"] == cloud["node_key"]
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
                                       "placement": {"trainer_nodes": 1,
                                                     "trainer_gpus_per_node": 1}})
    run_dir = node.root / "runs" / "flows" / f"run-{run_id}"
    wait_for(lambda: (run_dir / "logs" / "trainer.log").exists(), 600, "the trainer on the node")
    # While the run's credentials are live: what a node of another run can do with Prefect's API.
    _another_runs_node_reads_prefect(cloud, run_id, stack["url"])
    # Every process below the node's worker: the flow runs and what they started.
    views = [v for pid in cloud_sim.descendants(cloud["worker"].pid)
             if (v := cloud_sim.process_view(pid)) is not None]
    assert any("prefect.engine" in v["cmdline"] for v in views), views
    for v in views:
        if Path(v["argv0"]).name.startswith("python"):  # not a tool a library shells out to
            assert v["argv0"].startswith(str(node.venv)), v
        assert not v["cwd"].startswith(str(ROOT)), v
        assert str(ROOT) not in v["pythonpath"], v
    # The server listens on its node's address (from the metadata service), in the port range.
    server = next(v["cmdline"].split() for v in views if "rollout_server.server" in v["cmdline"])
    assert server[server.index("--host") + 1] == NODE, server
    assert 41000 <= int(server[server.index("--port") + 1]) <= 41499, server

    wait_for(lambda: run_status(run_id) in ("succeeded", "failed", "cancelled"), 600,
             "the run to end")
    run = Run.objects.get(id=run_id)
    events = list(RunEvent.objects.filter(run_id=run_id).order_by("id"))
    assert run.status == "succeeded", (run.status_reason,
                                       [(e.kind, e.message) for e in events][-10:])
    # Every process ran on the node, in the runs_dir its cloud-init gave it; none on the
    # control machine, although the run has one node.
    assert {"trainer.log", "rollout-server-0.log"} <= {p.name for p in (run_dir / "logs").glob("*")}
    control = stack["runs_dir"] / "flows" / f"run-{run_id}" / "logs"
    assert not list(control.glob("trainer*.log")) and not list(control.glob("rollout-server*"))
    # Ray placed it (its cluster headed by the node's oolong-ray unit), trainer and server on
    # disjoint GPUs of the one node, each process with its bundle's GPUs.
    placements = [e for e in events if e.kind == "placement"]
    assert len(placements) == 1 and placements[0].message.startswith(
        f"placement plan (by Ray at {os.environ['OOLONG_RAY_ADDRESS']}): "), placements
    plan = placements[0].data["plan"]
    assert [t["node"] for t in plan["trainers"]] == ["node-0"] == \
        [s["node"] for s in plan["servers"]], plan
    owned = {"trainer": plan["trainers"][0]["gpus"], "server": plan["servers"][0]["gpus"]}
    assert owned["trainer"] and set(owned["trainer"]).isdisjoint(owned["server"]), owned
    for v in views:
        role = ("server" if "rollout_server.server" in v["cmdline"] else
                "trainer" if "training_core.cli" in v["cmdline"] else None)
        if role:
            assert v["gpus"] == ",".join(map(str, owned[role])), (role, v)
    assert any("training_core.cli" in v["cmdline"] for v in views), views
    # The model came from the run's store, checked against the hash the flow published, and
    # the node's processes ran on it.
    model = next(e for e in events if e.kind == "model")
    digest = model.data["sha256"]
    fetched = run_dir / "model" / "MANIFEST.json"
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == digest
    assert (cloud["store"] / f"run-{run_id}" / "model" / "COMPLETE").exists()
    assert f"--model-path {run_dir / 'model'}" in " ".join(server)
    # The durable store received the run's checkpoints.
    assert any((cloud["store"] / f"run-{run_id}" / "checkpoints").glob("step*/COMPLETE"))
    wait_for_exit(run_id, 60, "every process of the run to exit")
    wait_for(lambda: not cloud_sim.descendants(cloud["worker"].pid), 60,
             "the node's flow runs to exit")

    # No secret in any flow run's parameters, Prefect log or event, run event or log file.
    texts = [json.dumps(r["parameters"]) for r in _flow_runs(cloud)]
    logs = _prefect(cloud, "/logs/filter", {"limit": 200}).json()
    assert any("rollout server 0 serving" in entry["message"] for entry in logs)
    texts += [entry["message"] for entry in logs]
    prefect_events = _prefect(cloud, "/events/filter", {"limit": 50})
    assert prefect_events.status_code == 200 and prefect_events.json()["events"], \
        prefect_events.text[:300]
    texts.append(prefect_events.text)
    texts += [e.message + json.dumps(e.data) for e in events]
    files = [*node.root.glob("*.log"), *run_dir.glob("logs/*.log"),
             *(stack["runs_dir"] / "flows" / f"run-{run_id}").glob("*.log"), stack["worker_log"]]
    texts += [p.read_text(errors="replace") for p in files]
    _no_secret_anywhere(cloud, run_id, texts)
    # and the scan finds a token where there is one
    from webapp.runs.services import run_token_issue

    with pytest.raises(AssertionError):
        _no_secret_anywhere(cloud, run_id, [f"a log line with {run_token_issue(run=run, purpose='x')}"])
