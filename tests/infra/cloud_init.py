"""The GPU node's cloud-init as Terraform itself renders it (``templatefile`` in ``terraform
console``, as the gpu_node_pool module renders each instance's user_data), with the values the
module would give it for a run of 8-GPU nodes, any of them overridden."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "infra" / "terraform" / "modules" / "gpu_node_pool" / "cloud-init.yaml.tftpl"
STORE = "s3://ckpt-bucket/oolong"
NODE_KEY = "x" * 43 + "="
PREFECT_AUTH = "oolong:" + "p" * 40


def _file(name: str, digest: str) -> dict[str, str]:
    return {"url": f"{STORE}/builds/{digest * 64}/{name}", "sha256": digest * 64}


VALUES = {
    "oolong_build": {"wheel": _file("oolong-0.1.0-py3-none-any.whl", "a"),
                     "constraints": _file("constraints-gpu.txt", "b"),
                     "sglang_constraints": _file("constraints-sglang.txt", "c")},
    "sglang_version": "0.5.23", "prefect_api_url": "http://10.0.0.5:4200/api",
    "prefect_api_auth_string": PREFECT_AUTH, "node_key": NODE_KEY, "efa": False,
    "work_pool": "oolong-run-7", "node_index": 0, "port_range": "30000-30999",
    "checkpoint_store": STORE, "runs_dir": "/opt/oolong/runs", "gpus": 8,
    "ray_head_address": "10.0.1.10", "ray_port": 6379, "ray_client_port": 10001,
}


def render_text(workdir: Path, **overrides) -> str:
    values = {**VALUES, **overrides}
    args = ", ".join(f"{k}={json.dumps(v)}" for k, v in values.items())
    workdir.mkdir(parents=True, exist_ok=True)  # empty: console leaves no state in the repository
    out = subprocess.run(["terraform", "console"], input=f'templatefile("{TEMPLATE}", {{{args}}})',
                         cwd=workdir, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TF_CLI_CONFIG_FILE": "/dev/null"})
    if out.returncode != 0:
        raise RuntimeError(f"terraform console failed: {out.stderr}")
    return out.stdout.strip().removeprefix("<<EOT").removesuffix("EOT").strip() + "\n"


def render(workdir: Path, **overrides) -> dict:
    return yaml.safe_load(render_text(workdir, **overrides))


def files(doc: dict) -> dict[str, str]:
    return {f["path"]: f["content"] for f in doc["write_files"]}


def commands(doc: dict) -> list[str]:
    return [c for c in doc["runcmd"] if isinstance(c, str)]


def env_file(doc: dict) -> dict[str, str]:
    text = files(doc)["/etc/oolong/node.env"]
    return dict(line.split("=", 1) for line in text.splitlines()
                if line.strip() and not line.startswith("#"))
