"""Terraform without providers: every file parses, variables are typed and described, modules
expose what the orchestration reads, formatting is canonical, and checkov finds nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "infra" / "terraform"
MODULE_DIRS = [TF / "modules" / "gpu_node_pool", TF / "modules" / "control_plane", TF / "run",
               TF / "envs" / "dev", TF / "envs" / "prod"]
CHECKOV = Path(os.environ.get("OOLONG_CHECKOV", ROOT / ".cache" / "tools" / "checkov" / "bin" / "checkov"))


def _load(path: Path) -> dict:
    with path.open() as fh:
        return hcl2.load(fh)


def _blocks(directory: Path, kind: str) -> dict[str, dict]:
    out = {}
    for f in directory.glob("*.tf"):
        for block in _load(f).get(kind, []):
            for name, body in block.items():
                out[name.strip('"')] = body
    return out


@pytest.mark.parametrize("path", sorted(TF.rglob("*.tf")), ids=lambda p: str(p.relative_to(TF)))
def test_every_tf_file_parses(path):
    assert isinstance(_load(path), dict)


@pytest.mark.parametrize("directory", MODULE_DIRS, ids=lambda p: str(p.relative_to(TF)))
def test_every_variable_has_a_type_and_a_description(directory):
    variables = _blocks(directory, "variable")
    assert variables, f"{directory} declares no variables"
    for name, body in variables.items():
        assert "type" in body, f"{directory.name}: variable {name} has no type"
        assert str(body.get("description", "")).strip(), f"{directory.name}: variable {name} has no description"


def test_gpu_pool_and_run_module_expose_what_the_provider_reads():
    from orchestration.providers.terraform import REQUIRED_VARS

    wanted = {"node_addresses", "private_addresses", "gpus_per_node", "ssh_user", "ray_address"}
    assert wanted <= set(_blocks(TF / "modules" / "gpu_node_pool", "output"))
    assert wanted <= set(_blocks(TF / "run", "output"))
    run_vars = set(_blocks(TF / "run", "variable"))
    assert {"run_id", *REQUIRED_VARS} <= run_vars
    # every variable a run spec may set (orchestration.terraform_vars) is one of the module's
    from training_core.config import TerraformVarsSpec

    assert set(TerraformVarsSpec.model_fields) <= run_vars
    for name, body in _blocks(TF / "run", "output").items():
        assert str(body.get("description", "")).strip(), f"output {name} has no description"


def test_control_plane_outputs_for_the_settings():
    outputs = set(_blocks(TF / "modules" / "control_plane", "output"))
    assert {"database_endpoint", "redis_endpoint", "app_private_address"} <= outputs


def test_example_tfvars_set_only_declared_variables():
    for env in ("dev", "prod"):
        declared = set(_blocks(TF / "envs" / env, "variable"))
        example = _load(TF / "envs" / env / "terraform.tfvars.example")
        assert set(example) <= declared, set(example) - declared


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary on this machine")
def test_terraform_fmt_is_clean():
    out = subprocess.run(["terraform", "fmt", "-recursive", "-check", "-diff"], cwd=TF,
                         capture_output=True, text=True, env={**os.environ, "TF_CLI_CONFIG_FILE": "/dev/null"})
    assert out.returncode == 0, out.stdout + out.stderr


def test_checkov_finds_no_failed_checks(tmp_path):
    if not CHECKOV.exists():
        pytest.skip("checkov is not installed (make test installs it into .cache/tools/checkov)")
    out = subprocess.run([str(CHECKOV), "-d", str(TF), "--framework", "terraform", "--compact",
                          "--quiet", "-o", "json", "--skip-download"],
                         capture_output=True, text=True, timeout=600)
    report = json.loads(out.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [f"{c['check_id']} {c['resource']} ({c['file_path']})"
              for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    assert not failed, "\n".join(failed)


def _render_cloud_init(tmp_path: Path, node_index: int) -> dict:
    """The node's cloud-init as Terraform itself renders it (templatefile in `terraform
    console`), with the module's values for a run of 8-GPU nodes."""
    from tests.infra import cloud_init

    return cloud_init.render(tmp_path / f"node-{node_index}", node_index=node_index)


def test_cloud_init_joins_the_runs_ray_cluster_node_0_heading_it(tmp_path):
    """Every node joins the run's Ray cluster with its GPUs and its queue as the label the
    placement reads (orchestration/ray_placement.py); node 0, at the module's fixed address,
    heads it and serves Ray Client to the control plane."""
    from orchestration.ray_placement import NODE_LABEL

    def ray_args(doc: dict) -> list[str]:
        files = {f["path"]: f["content"] for f in doc["write_files"]}
        unit = files["/etc/systemd/system/oolong-ray.service"]
        assert "EnvironmentFile=/etc/oolong/node.env" in unit  # OOLONG_NODE_ADDRESS
        return next(line for line in unit.splitlines() if line.startswith("ExecStart=")).split()

    head, other = ray_args(_render_cloud_init(tmp_path, 0)), ray_args(_render_cloud_init(tmp_path, 2))
    for args, index in ((head, 0), (other, 2)):
        assert args[0] == "ExecStart=/opt/oolong/venv/bin/ray" and args[1:3] == ["start", "--block"]
        assert args[args.index("--num-gpus") + 1] == "8"
        assert args[args.index("--labels") + 1] == f"{NODE_LABEL}=node-{index}"
        assert args[args.index("--node-ip-address") + 1] == "${OOLONG_NODE_ADDRESS}"
    assert "--head" in head and "--address" not in head
    assert head[head.index("--port") + 1] == "6379"
    assert head[head.index("--ray-client-server-port") + 1] == "10001"
    assert "--head" not in other and other[other.index("--address") + 1] == "10.0.1.10:6379"
    cmds = [c for c in _render_cloud_init(tmp_path, 1)["runcmd"] if isinstance(c, str)]
    assert "systemctl enable --now oolong-ray.service oolong-prefect-worker.service" in cmds
    # the fixed head address is node 0's, and the control plane is told where to connect
    instance = _pool_resources("aws_instance")["node"]
    assert instance["private_ip"] == "${local.efa ? null : (count.index == 0 ? local.ray_head_ip : null)}"
    # with EFA, node 0's primary interface (card 0) holds it
    assert _pool_resources("aws_network_interface")["efa"]["private_ips"] == \
        "${count.index == 0 ? [local.ray_head_ip] : null}"
    outputs = {name.strip('"'): body for block in _load(TF / "run" / "outputs.tf")["output"]
               for name, body in block.items()}
    assert outputs["ray_address"]["value"] == "${module.pool.ray_address}"


def test_cloud_init_renders_a_worker_that_serves_the_nodes_queue(tmp_path):
    """The node's worker serves its own queue, the one the orchestration places processes on."""
    from orchestration.providers.base import node_queue

    doc = _render_cloud_init(tmp_path, 2)
    files = {f["path"]: f["content"] for f in doc["write_files"]}
    unit = files["/etc/systemd/system/oolong-prefect-worker.service"]
    start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    args = start.split()
    assert args[args.index("--pool") + 1] == "oolong-run-7"
    assert args[args.index("--work-queue") + 1] == node_queue(2) == "node-2"
    assert args[args.index("--type") + 1] == "process"
    env = dict(line.split("=", 1) for line in files["/etc/oolong/node.env"].splitlines() if line)
    assert env["PREFECT_API_URL"] == "http://10.0.0.5:4200/api"
    assert env["OOLONG_NODE_QUEUE"] == "node-2"
    assert any("OOLONG_NODE_ADDRESS" in cmd for cmd in doc["runcmd"] if isinstance(cmd, str))
    # the durable store and the run directories, the open port range, SGLang's own environment
    assert env["OOLONG_CHECKPOINT_STORE"] == "s3://ckpt-bucket/oolong"
    assert env["OOLONG_RUNS_DIR"] == "/opt/oolong/runs"
    assert env["OOLONG_PORT_RANGE"] == "30000-30999"
    assert env["OOLONG_SGLANG_PYTHON"] == "/opt/sglang/venv/bin/python"
    cmds = [c for c in doc["runcmd"] if isinstance(c, str)]
    # SGLang in its own Python 3.11 environment, on its own pins (test_node_install.py checks
    # every environment's interpreter and the build by hash)
    assert "python3.11 -m venv /opt/sglang/venv" in cmds
    assert ("/opt/sglang/venv/bin/pip install --no-input -c /opt/oolong/dist/"
            'constraints-sglang.txt "sglang==0.5.23"') in cmds
    # the worker polls often enough for the flow's liveness check (worker_lost_after_s)
    assert int(env["PREFECT_WORKER_QUERY_SECONDS"]) <= 15
    # the reward jail can be built there: bubblewrap, libseccomp and its unprivileged user
    assert {"bubblewrap", "libseccomp2"} <= set(doc["packages"])
    assert any("useradd" in c and "oolong-jail" in c for c in cmds)


def _pool_resources(kind: str) -> dict[str, dict]:
    return {name.strip('"'): body for f in (TF / "modules" / "gpu_node_pool").glob("*.tf")
            for block in _load(f).get("resource", []) for k, named in block.items()
            if k.strip('"') == kind for name, body in named.items()}


def test_nodes_reach_the_prefect_api_and_open_only_the_server_port_range():
    ingress = _pool_resources("aws_vpc_security_group_ingress_rule")
    egress = _pool_resources("aws_vpc_security_group_egress_rule")
    servers = ingress["servers_from_control_plane"]
    assert servers["from_port"] == "${var.server_port_range.from}"
    assert servers["to_port"] == "${var.server_port_range.to}"
    assert "${each.value}" in servers["cidr_ipv4"]  # the control plane's CIDRs, nobody else
    assert "rollout_from_control_plane" not in ingress  # the single fixed port is gone
    ray_client = ingress["ray_client_from_control_plane"]  # the flow places runs through it
    assert ray_client["from_port"] == ray_client["to_port"] == "${var.ray_client_port}"
    assert "${each.value}" in ray_client["cidr_ipv4"]
    prefect = egress["prefect_api"]
    assert prefect["from_port"] == prefect["to_port"] == "${var.prefect_api_port}"
    assert {r["from_port"] for r in egress.values() if "from_port" in r} >= {443, 80}
    run = _load(TF / "run" / "main.tf")
    pool = next(body for name, body in run["module"][0].items() if name.strip('"') == "pool")
    assert pool["prefect_api_port"] == "${local.prefect_api_port}"
    assert pool["checkpoint_run_key"].strip('"') == "run-${var.run_id}"


def test_the_node_role_may_use_only_its_runs_prefix_of_the_bucket():
    policy = _pool_resources("aws_iam_role_policy")["checkpoints"]["policy"]
    text = json.dumps(policy)
    assert "arn:aws:s3:::${var.checkpoint_bucket}/${local.store_prefix}/*" in text
    assert '"s3:*"' not in text and "arn:aws:s3:::*" not in text
    assert "s3:prefix" in text  # listing is limited to the run's prefix too


def test_the_runs_vpc_is_peered_with_the_control_planes_when_given():
    """With control_plane_vpc_id the flow reaches the nodes at their private addresses (the
    ones servers announce): a peering, routes both ways, that VPC opened like the control
    plane's CIDRs, and Ray Client at node 0's private address."""
    peering = _pool_resources("aws_vpc_peering_connection")["control_plane"]
    assert peering["count"] == "${local.peered ? 1 : 0}"
    assert peering["vpc_id"] == "${aws_vpc.pool.id}"
    assert peering["peer_vpc_id"] == "${var.control_plane_vpc_id}"
    back = _pool_resources("aws_route")["control_plane_to_pool"]
    assert back["destination_cidr_block"] == "${aws_vpc.pool.cidr_block}"
    assert back["route_table_id"] == "${var.control_plane_route_table_ids[count.index]}"
    there = _pool_resources("aws_route")["pool_to_control_plane"]
    assert there["count"] == "${local.peered ? 1 : 0}"
    assert there["destination_cidr_block"] == "${var.control_plane_vpc_cidr}"
    assert there["vpc_peering_connection_id"] == "${aws_vpc_peering_connection.control_plane[0].id}"
    assert "route" not in _pool_resources("aws_route_table")["pool"]  # none inline: no clash
    ingress = _pool_resources("aws_vpc_security_group_ingress_rule")
    for rule in ("servers_from_control_plane", "ray_client_from_control_plane"):
        assert ingress[rule]["for_each"] == "${toset(local.control_cidrs)}", rule
    locals_ = {k: v for block in _load(TF / "modules" / "gpu_node_pool" / "main.tf")["locals"]
               for k, v in block.items()}
    assert "var.control_plane_vpc_cidr" in locals_["control_cidrs"]
    outputs = _blocks(TF / "modules" / "gpu_node_pool", "output")
    assert "local.peered ? local.ray_head_ip" in outputs["ray_address"]["value"]
    run = _load(TF / "run" / "main.tf")
    pool = next(body for name, body in run["module"][0].items() if name.strip('"') == "pool")
    assert pool["control_plane_vpc_id"] == "${var.control_plane_vpc_id}"


def test_the_runs_vpc_range_is_the_one_the_spec_keeps_the_control_plane_out_of():
    """Runs peered at once with one control plane need ranges of their own; the range is
    written twice (HCL cannot import Python): config.RUN_VPC_OCTETS and run/main.tf agree."""
    from training_core.config import RUN_VPC_OCTETS, SpecError, load_spec

    first, count = RUN_VPC_OCTETS[0], len(RUN_VPC_OCTETS)
    run = _load(TF / "run" / "main.tf")
    pool = next(body for name, body in run["module"][0].items() if name.strip('"') == "pool")
    assert pool["vpc_cidr"].strip('"') == f"10.${{{first} + var.run_id % {count}}}.0.0/16"
    variables = _blocks(TF / "run", "variable")
    shown = f"10.{first}.0.0-10.{RUN_VPC_OCTETS[-1]}.255.255"
    assert shown in variables["control_plane_vpc_cidr"]["description"]
    base = ["orchestration.provider=terraform", "orchestration.terraform_vars.control_plane_vpc_id="
            "vpc-0123456789abcdef0"]
    field = "orchestration.terraform_vars.control_plane_vpc_cidr"
    for octet, refused in ((first - 1, False), (first, True), (RUN_VPC_OCTETS[-1], True),
                           (RUN_VPC_OCTETS[-1] + 1, False)):
        with pytest.raises(SpecError) as err:  # the other required variables are left out
            load_spec(None, base + [f"{field}=10.{octet}.0.0/16"])
        assert (field in err.value.errors) == refused, octet


def test_the_build_and_the_nodes_secrets_are_required_typed_variables():
    """No default that installs anything by name: the build is a typed URL + sha256 per file,
    the node key and the Prefect credential are sensitive, and the run module passes them."""
    pool = _blocks(TF / "modules" / "gpu_node_pool", "variable")
    build = pool["oolong_build"]
    assert "default" not in build
    assert build["type"] == ("${object({wheel = object({url = string, sha256 = string}), "
                             "constraints = object({url = string, sha256 = string}), "
                             "sglang_constraints = object({url = string, sha256 = string})})}")
    assert len(build["validation"]) == 2  # URL and hash shapes; the wheel is a .whl
    for name in ("node_key", "prefect_api_auth_string"):
        assert pool[name]["sensitive"] is True and "default" not in pool[name], name
    run = _load(TF / "run" / "main.tf")
    module = next(body for name, body in run["module"][0].items() if name.strip('"') == "pool")
    for name in ("oolong_build", "node_key", "prefect_api_auth_string", "efa"):
        assert module[name] == f"${{var.{name}}}", name


def test_efa_interfaces_on_p4d_and_p5_only():
    """Each network card of a p4d (4) or p5 (32) gets an EFA interface, the primary one with
    the node's public address; every other type keeps one ordinary interface (NCCL over TCP)."""
    locals_ = {k: v for block in _load(TF / "modules" / "gpu_node_pool" / "main.tf")["locals"]
               for k, v in block.items()}
    per_type = {k.strip('"'): v for k, v in locals_["efa_per_type"].items()}
    assert per_type["p4d.24xlarge"] == 4 and per_type["p5.48xlarge"] == 32
    assert not {"g5.xlarge", "g5.48xlarge", "g6.12xlarge"} & set(per_type)
    assert locals_["efa_count"] == "${var.efa ? lookup(local.efa_per_type, var.instance_type, 0) : 0}"
    eni = _pool_resources("aws_network_interface")["efa"]
    assert eni["interface_type"].strip('"') == "efa" and eni["count"] == "${var.node_count * local.efa_count}"
    assert eni["security_groups"] == ["${aws_security_group.pool.id}"]
    node = _pool_resources("aws_instance")["node"]
    nic = next(d['"network_interface"'] for d in node["dynamic"] if '"network_interface"' in d)
    assert nic["for_each"] == "${range(local.efa_count)}"
    assert nic["content"][0]["network_card_index"] == "${network_interface.value}"
    assert node["subnet_id"] == "${local.efa ? null : aws_subnet.pool.id}"
    eip = _pool_resources("aws_eip")["efa"]
    assert eip["network_interface"] == "${aws_network_interface.efa[count.index * local.efa_count].id}"
    # EFA needs the group to let the pool reach itself on every protocol, both ways
    for kind in ("aws_vpc_security_group_ingress_rule", "aws_vpc_security_group_egress_rule"):
        rule = _pool_resources(kind)["intra_pool"]
        assert rule["ip_protocol"].strip('"') == "-1"
        assert rule["referenced_security_group_id"] == "${aws_security_group.pool.id}"
