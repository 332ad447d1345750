#!/usr/bin/env python3
"""A stand-in `terraform` for tests (providers cannot be downloaded here).

Implements the CLI surface the TerraformNodeProvider uses, with Terraform's own conventions:
`init` creates .terraform/, `apply -auto-approve -var-file=F` "creates" resources into
terraform.tfstate (a failed apply leaves the resources it made in the state, like the real one),
`output -json` prints {"name": {"sensitive": false, "type": ..., "value": ...}}, `destroy`
empties the state. Every call is appended to $OOLONG_FAKE_TF_LOG. The node is this machine (127.0.0.1),
so a flow provisioned by it really runs.

Failure switches, by instance_type: "fake.fail-apply" (apply dies after the network exists),
"fake.fail-destroy", "fake.hang-apply" (sleeps past any sane timeout).
"""

import json
import os
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
            "ray_address": {"sensitive": False, "type": "string", "value": "ray://127.0.0.1:10001"},
        }
        save(resources, outputs)
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
        save([], {})
        print(f"Destroy complete! Resources: {len(state['resources'])} destroyed.")
        return 0
    print(f"Error: unknown command {cmd!r}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
