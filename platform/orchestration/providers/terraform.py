"""GPU nodes from the cloud with Terraform: one workspace (and state) per run.

provision(): copy infra/terraform into ``<workspaces>/run-<id>/``, render ``run.tfvars.json``
from the run spec's ``orchestration.terraform_vars``, ``terraform init`` + ``apply``, and turn
``terraform output -json`` into the node inventory. release(): ``terraform destroy``, called by the
flow's ``finally`` whatever happened (success, failure, cancellation, an apply that failed half
way). Cloud specifics stay in the Terraform modules; this class only knows the CLI and the
outputs contract (node_addresses, private_addresses, gpus_per_node, ssh_user).

What the spec cannot give, the provider adds to the variables: the exact build the nodes install
(published in the run's store by hash first: orchestration/builds.py), the run's node key (made
here, kept beside the run's state, root's only: the flow seals the nodes' credentials with it)
and the Prefect API's credential (this process's ``PREFECT_API_AUTH_STRING``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from orchestration.providers.base import Node, NodeInventory
from orchestration.sealing import new_key

INFRA = Path(__file__).resolve().parents[3] / "infra" / "terraform"
REQUIRED_VARS = ("region", "availability_zone", "instance_type", "node_count", "prefect_api_url")
# Where this control plane writes the run's store when it does not reach the bucket as
# s3://<checkpoint_bucket>/<checkpoint_prefix> (the fake-Terraform tests: a folder).
STORE_URL_ENV = "OOLONG_TERRAFORM_STORE_URL"
PREFECT_AUTH_ENV = "PREFECT_API_AUTH_STRING"
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                  "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")


class TerraformError(RuntimeError):
    pass


class TerraformNodeProvider:
    name = "terraform"

    def __init__(self, *, terraform_bin: str | None = None, workspaces_root: str | Path | None = None,
                 infra_dir: str | Path | None = None, timeout_s: float = 3600.0,
                 check_credentials: bool | None = None):
        self.bin = terraform_bin or os.environ.get("OOLONG_TERRAFORM_BIN") or shutil.which("terraform")
        self.root = Path(workspaces_root or os.environ.get(
            "OOLONG_TERRAFORM_WORKSPACES", Path.cwd() / "runs" / "terraform"))
        self.infra = Path(infra_dir or INFRA)
        self.timeout_s = float(os.environ.get("OOLONG_TERRAFORM_TIMEOUT_S", timeout_s))
        if check_credentials is None:
            check_credentials = os.environ.get("OOLONG_TERRAFORM_SKIP_CREDENTIAL_CHECK") != "1"
        self.check_credentials = check_credentials

    # ---- helpers ---------------------------------------------------------------------------

    def workspace(self, run_id: int) -> Path:
        return self.root / f"run-{run_id}" / "run"

    def _key_file(self, run_id: int) -> Path:
        return self.root / f"run-{run_id}" / "node.key"

    def store_url(self, spec: dict) -> str | None:
        given = (spec.get("orchestration") or {}).get("terraform_vars") or {}
        bucket = given.get("checkpoint_bucket") or ""
        if not bucket:
            return None
        prefix = str(given.get("checkpoint_prefix") or "oolong").strip("/")
        return os.environ.get(STORE_URL_ENV) or f"s3://{bucket}/{prefix}"

    def node_key(self, run_id: int) -> str:
        """The run's node key: made once per run (a resumed attempt on the same workspace keeps
        it), readable by this user only."""
        path = self._key_file(run_id)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(new_key())
        return path.read_text().strip()

    def _private_vars(self, run_id: int, spec: dict) -> dict:
        """What the provider adds: the build by hash, the node key, the Prefect credential."""
        from orchestration.builds import publish_build

        store = self.store_url(spec)
        if store is None:
            raise TerraformError(
                "orchestration.terraform_vars.checkpoint_bucket is empty: cloud nodes get the "
                "exact build and the run's model through the run's store; name an S3 bucket")
        auth = os.environ.get(PREFECT_AUTH_ENV, "")
        if not auth:
            raise TerraformError(
                f"{PREFECT_AUTH_ENV} is not set: the nodes' workers present it to the Prefect "
                "API, which requires authentication in production (PREFECT_SERVER_API_AUTH_STRING "
                "on the server; docs/orchestration.md)")
        return {"oolong_build": publish_build(store), "node_key": self.node_key(run_id),
                "prefect_api_auth_string": auth}

    def _require_binary(self) -> str:
        if not self.bin or not Path(self.bin).exists():
            raise TerraformError("terraform binary not found: install Terraform >= 1.5 or set "
                                 "OOLONG_TERRAFORM_BIN to its path")
        return self.bin

    def _require_credentials(self) -> None:
        if not self.check_credentials:
            return
        has_file = (Path.home() / ".aws" / "credentials").exists()
        if not has_file and not any(os.environ.get(k) for k in CREDENTIAL_ENV):
            raise TerraformError("no cloud credentials: set AWS_PROFILE or AWS_ACCESS_KEY_ID/"
                                 "AWS_SECRET_ACCESS_KEY (or an instance role via AWS_* variables)")

    def _run(self, args: list[str], cwd: Path, what: str) -> str:
        cmd = [self._require_binary(), *args]
        env = {**os.environ, "TF_IN_AUTOMATION": "1", "TF_INPUT": "0"}
        try:
            out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                 timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise TerraformError(f"terraform {what} timed out after {self.timeout_s:.0f}s") from None
        (cwd / f"terraform-{what}.log").write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-15:])
            raise TerraformError(f"terraform {what} failed (exit {out.returncode}):\n{tail}")
        return out.stdout

    @staticmethod
    def render_vars(run_id: int, spec: dict) -> dict:
        given = dict((spec.get("orchestration") or {}).get("terraform_vars") or {})
        missing = [k for k in REQUIRED_VARS if given.get(k) is None]
        if missing:
            raise TerraformError("orchestration.terraform_vars is missing " + ", ".join(missing)
                                 + f" (needs {', '.join(REQUIRED_VARS)})")
        # Typed and checked by the run spec (TerraformVarsSpec); the run id is always the run's.
        return {**{k: v for k, v in given.items() if v is not None}, "run_id": run_id}

    @staticmethod
    def parse_outputs(raw: str) -> NodeInventory:
        try:
            outputs = {k: v["value"] for k, v in json.loads(raw).items()}
        except (ValueError, KeyError, AttributeError):
            raise TerraformError(f"terraform output -json returned something unexpected: {raw[:300]}") from None
        missing = [k for k in ("node_addresses", "gpus_per_node", "ssh_user") if k not in outputs]
        if missing:
            raise TerraformError(f"the run module does not output {missing}")
        public = outputs["node_addresses"]
        private = outputs.get("private_addresses") or [None] * len(public)
        if not public:
            raise TerraformError("terraform created no nodes")
        nodes = [Node(address=a, gpus=int(outputs["gpus_per_node"]), ssh_user=outputs["ssh_user"],
                      private_address=p) for a, p in zip(public, private, strict=True)]
        # dedicated: every node is this run's (the flow waits for all of them before placing)
        return NodeInventory(nodes, meta={"provider": "terraform", "outputs": outputs,
                                          "dedicated": True})

    # ---- NodeProvider ------------------------------------------------------------------------

    def provision(self, run_id: int, spec: dict) -> NodeInventory:
        self._require_binary()
        self._require_credentials()
        variables = {**self.render_vars(run_id, spec), **self._private_vars(run_id, spec)}
        tree = self.workspace(run_id).parent
        if not (tree / "run").exists():  # the modules travel with the workspace
            shutil.copytree(self.infra, tree, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*"),
                            dirs_exist_ok=True)
        ws = self.workspace(run_id)
        # secrets inside (the node key, the Prefect credential): this user's only
        tfvars = ws / "run.tfvars.json"
        tfvars.unlink(missing_ok=True)
        with os.fdopen(os.open(tfvars, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(json.dumps(variables, indent=2))
        self._run(["init", "-input=false", "-no-color"], ws, "init")
        self._run(["apply", "-auto-approve", "-input=false", "-no-color", "-var-file=run.tfvars.json"],
                  ws, "apply")
        return self.parse_outputs(self._run(["output", "-json"], ws, "output"))

    def release(self, run_id: int) -> None:
        ws = self.workspace(run_id)
        if not (ws / "run.tfvars.json").exists() or not (ws / ".terraform").exists():
            return  # nothing was attempted, or init failed: nothing can exist
        self._run(["destroy", "-auto-approve", "-input=false", "-no-color", "-var-file=run.tfvars.json"],
                  ws, "destroy")
