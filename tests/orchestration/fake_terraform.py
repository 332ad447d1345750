#!/usr/bin/env python3
"""A stand-in `terraform` for tests (providers cannot be downloaded here).

Implements the CLI surface the TerraformNodeProvider uses, with Terraform's own conventions:
`init` creates .terraform/, `apply -auto-approve -var-file=F` "creates" resources into
terraform.tfstate (a failed apply leaves the resources it made in the state, like the real one),
`output -json` prints {"name": {"sensitive": false, "type": ..., "value": ...}}, `destroy`
empties the state. Every call is appended to $OOLONG_FAKE_TF_LOG. The node is this machine (127.0.0.1),
so a flow provisioned by it really runs.

With $OOLONG_FAKE_TF_BOOT=1, apply also boots each node as its cloud-init would leave it: the
build it was given must be in the store with its hash (cloud-init refuses it otherwise, and the
node never comes up), and a Prefect worker serves the node's queue in the run's pool with what
cloud-init writes into node.env (the Prefect API and its credential, the run's node key, the
store, its own runs directory); destroy stops them. The bucket is $OOLONG_TERRAFORM_STORE_URL (no
S3 here). Its Python is this checkout's, its address 127.0.0.1: the simulated-cloud test is the
one that boots a node from the rendered cloud-init itself.

Failure switches, by instance_type: "fake.fail-apply" (apply dies after the network exists),
"fake.fail-destroy", "fake.hang-apply" (sleeps past any sane timeout).
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path("terraform.tfstate")


def record(argv):
    log = os.environ.get("OOLONG_FAKE_TF_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(json.dumps({"argv": argv, "cwd": os.getcwd(), "time": time.time()}) + "\n")


def var_file(argv):
    for a in argv:
        if a.startswith("-var-file="):
            return json.loads(Path(a.split("=", 1)[1]).read_text())
    print("Error: No value for required variable", file=sys.stderr)
    sys.exit(1)


def save(resources, outputs):
    STATE.write_text(json.dumps({"version": 4, "resources": resources, "outputs": outputs}))


def boot(v: dict) -> list[int]:
    """The nodes' workers, as cloud-init starts them (see the module docstring); their pids."""
    for name, f in v["oolong_build"].items():
        path = Path(f["url"].removeprefix("file://"))
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != f["sha256"]:
            print(f"cloud-init: {name} failed its sha256 check: the node does not come up",
                  file=sys.stderr)
            return []
    pids = []
    for i in range(int(v["node_count"])):
        node = Path.cwd().parent / "nodes" / f"node-{i}"
        (node / "runs").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PREFECT_API_URL": v["prefect_api_url"],
               "PREFECT_API_AUTH_STRING": v["prefect_api_auth_string"],
               "PREFECT_WORKER_QUERY_SECONDS": "2", "OOLONG_NODE_KEY": v["node_key"],
               "OOLONG_NODE_ADDRESS": "127.0.0.1", "OOLONG_RUNS_DIR": str(node / "runs"),
               "OOLONG_CHECKPOINT_STORE": os.environ["OOLONG_TERRAFORM_STORE_URL"]}
        env.pop("OOLONG_INGEST_TOKEN", None)  # the flow's own: a node never has it
        python = os.environ.get("OOLONG_FAKE_TF_PYTHON", sys.executable)  # the node's install
        worker = subprocess.Popen(
            [python, "-m", "prefect", "worker", "start", "--pool",
             f"oolong-run-{v['run_id']}", "--work-queue", f"node-{i}", "--type", "process",
             "--name", f"node-{i}"], cwd=node / "runs", env=env,
            stdout=(node / "worker.log").open("w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        pids.append(worker.pid)
    return pids


def shut_down(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 20
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv):
    record(argv)
    if not argv:
        print("Usage: terraform [global options] <subcommand> [args]", file=sys.stderr)
        return 127
    cmd, rest = argv[0], argv[1:]
    if cmd == "version":
        print("Terraform v1.11.4 (fake)")
        return 0
    if cmd != "init" and not Path(".terraform").exists():
        print("Error: Backend initialization required, please run \"terraform init\"", file=sys.stderr)
        return 1
    if cmd == "init":
        Path(".terraform").mkdir(exist_ok=True)
        print("Terraform has been successfully initialized!")
        return 0
    if cmd == "apply":
        if "-auto-approve" not in rest:
            print("Error: apply needs approval (-auto-approve in automation)", file=sys.stderr)
            return 1
        v = var_file(rest)
        resources = ["module.pool.aws_vpc.pool", "module.pool.aws_subnet.pool",
                     "module.pool.aws_security_group.pool"]
        if v["instance_type"] == "fake.hang-apply":
            time.sleep(3600)
        if v["instance_type"] == "fake.fail-apply":
            save(resources, {})
            print("Error: creating EC2 Instance: InsufficientInstanceCapacity: We currently do not "
                  "have sufficient capacity in the Availability Zone you requested.", file=sys.stderr)
            return 1
        n = int(v["node_count"])
        resources += [f"module.pool.aws_instance.node[{i}]" for i in range(n)]
        outputs = {
            "node_addresses": {"sensitive": False, "type": ["list", "string"], "value": ["127.0.0.1"] * n},
            "private_addresses": {"sensitive": False, "type": ["list", "string"], "value": ["127.0.0.1"] * n},
            "gpus_per_node": {"sensitive": False, "type": "number", "value": 0},
            "ssh_user": {"sensitive": False, "type": "string", "value": "ubuntu"},
        }
        if os.environ.get("OOLONG_FAKE_TF_BOOT") != "1":
            # a cluster nobody runs here; booted nodes have no GPU and no Ray: the built-in plan
            outputs["ray_address"] = {"sensitive": False, "type": "string",
                                      "value": "ray://127.0.0.1:10001"}
        save(resources, outputs)
        if os.environ.get("OOLONG_FAKE_TF_BOOT") == "1":
            Path("fake-nodes.json").write_text(json.dumps(boot(v)))
        print(f"Apply complete! Resources: {len(resources)} added, 0 changed, 0 destroyed.")
        return 0
    if cmd == "output":
        state = json.loads(STATE.read_text()) if STATE.exists() else {"outputs": {}}
        print(json.dumps(state["outputs"]) if "-json" in rest else "\n".join(state["outputs"]))
        return 0
    if cmd == "destroy":
        v = var_file(rest)
        if v["instance_type"] == "fake.fail-destroy":
            print("Error: deleting EC2 VPC: DependencyViolation", file=sys.stderr)
            return 1
        state = json.loads(STATE.read_text()) if STATE.exists() else {"resources": []}
        nodes = Path("fake-nodes.json")
        if nodes.exists():
            shut_down(json.loads(nodes.read_text()))
            nodes.unlink()
        save([], {})
        print(f"Destroy complete! Resources: {len(state['resources'])} destroyed.")
        return 0
    print(f"Error: unknown command {cmd!r}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
