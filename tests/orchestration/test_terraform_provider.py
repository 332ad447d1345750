"""TerraformNodeProvider end to end against the stand-in terraform executable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from orchestration.providers import get_provider
from orchestration.providers.terraform import TerraformError, TerraformNodeProvider

FAKE = Path(__file__).with_name("fake_terraform.py")
VARS = {"region": "us-east-1", "availability_zone": "us-east-1a", "instance_type": "g5.xlarge",
        "node_count": 2, "prefect_api_url": "https://prefect.example/api",
        "checkpoint_bucket": "ckpt-bucket"}
AUTH = "oolong:" + "s" * 32


def _spec(**overrides):
    return {"orchestration": {"provider": "terraform", "terraform_vars": {**VARS, **overrides}}}


@pytest.fixture(autouse=True)
def _store_and_prefect(tmp_path, monkeypatch):
    """The bucket as this machine reaches it (a folder: no S3 here), the Prefect credential."""
    monkeypatch.setenv("OOLONG_TERRAFORM_STORE_URL", (tmp_path / "bucket").as_uri())
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", AUTH)


@pytest.fixture
def provider(tmp_path, monkeypatch):
    monkeypatch.setenv("OOLONG_FAKE_TF_LOG", str(tmp_path / "calls.jsonl"))
    return TerraformNodeProvider(terraform_bin=str(FAKE), workspaces_root=tmp_path / "ws",
                                 check_credentials=False)


def _calls(tmp_path):
    path = tmp_path / "calls.jsonl"
    return [json.loads(line)["argv"][0] for line in path.read_text().splitlines()] if path.exists() else []


def test_provision_parses_outputs_into_an_inventory_and_release_destroys(provider, tmp_path):
    inv = provider.provision(7, _spec())
    assert [n.address for n in inv.nodes] == ["127.0.0.1", "127.0.0.1"]
    assert inv.nodes[0].ssh_user == "ubuntu" and inv.meta["provider"] == "terraform"
    ws = provider.workspace(7)
    assert json.loads((ws / "run.tfvars.json").read_text())["run_id"] == 7
    assert (ws / "main.tf").exists() and (ws.parent / "modules" / "gpu_node_pool" / "main.tf").exists()
    provider.release(7)
    assert _calls(tmp_path) == ["init", "apply", "output", "destroy"]
    assert json.loads((ws / "terraform.tfstate").read_text())["resources"] == []


def test_the_provider_adds_the_build_by_hash_the_node_key_and_the_prefect_credential(
        provider, tmp_path, monkeypatch):
    """What the spec cannot set: the published build (each file in the store by its hash), the
    run's node key (kept, root's only), the Prefect credential; the variables file is private."""
    import hashlib

    provider.provision(11, _spec())
    tfvars = provider.workspace(11) / "run.tfvars.json"
    assert tfvars.stat().st_mode & 0o777 == 0o600
    variables = json.loads(tfvars.read_text())
    for name, f in variables["oolong_build"].items():
        path = Path(f["url"].removeprefix("file://"))
        assert hashlib.sha256(path.read_bytes()).hexdigest() == f["sha256"], name
        assert path.is_relative_to(tmp_path / "bucket" / "builds")
    assert variables["oolong_build"]["wheel"]["url"].endswith(".whl")
    assert variables["node_key"] == provider.node_key(11) != provider.node_key(12)
    assert (provider.root / "run-11" / "node.key").stat().st_mode & 0o777 == 0o600
    assert variables["prefect_api_auth_string"] == AUTH
    assert provider.store_url(_spec()) == (tmp_path / "bucket").as_uri()
    monkeypatch.delenv("OOLONG_TERRAFORM_STORE_URL")
    assert provider.store_url(_spec(checkpoint_prefix="a/b")) == "s3://ckpt-bucket/a/b"


def test_a_run_without_its_store_or_the_prefect_credential_is_refused(provider, monkeypatch):
    with pytest.raises(TerraformError, match="checkpoint_bucket is empty"):
        provider.provision(12, _spec(checkpoint_bucket=""))
    monkeypatch.delenv("PREFECT_API_AUTH_STRING")
    with pytest.raises(TerraformError, match="PREFECT_API_AUTH_STRING is not set"):
        provider.provision(13, _spec())


def test_apply_failing_half_way_still_gets_destroyed(provider, tmp_path):
    with pytest.raises(TerraformError, match="InsufficientInstanceCapacity"):
        provider.provision(8, _spec(instance_type="fake.fail-apply"))
    state = json.loads((provider.workspace(8) / "terraform.tfstate").read_text())
    assert state["resources"], "the failed apply left resources behind"
    provider.release(8)  # what the flow's finally does
    assert _calls(tmp_path) == ["init", "apply", "destroy"]
    assert json.loads((provider.workspace(8) / "terraform.tfstate").read_text())["resources"] == []


def test_missing_vars_binary_credentials_and_timeouts_are_clear(tmp_path, monkeypatch):
    p = TerraformNodeProvider(terraform_bin=str(FAKE), workspaces_root=tmp_path, check_credentials=False)
    with pytest.raises(TerraformError, match="missing instance_type, node_count"):
        p.provision(1, {"orchestration": {"terraform_vars": {"region": "x", "availability_zone": "y",
                                                             "prefect_api_url": "z"}}})
    with pytest.raises(TerraformError, match="terraform binary not found"):
        TerraformNodeProvider(terraform_bin=str(tmp_path / "nope"), workspaces_root=tmp_path,
                              check_credentials=False).provision(1, _spec())
    for k in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(TerraformError, match="no cloud credentials"):
        TerraformNodeProvider(terraform_bin=str(FAKE), workspaces_root=tmp_path,
                              check_credentials=True).provision(1, _spec())
    slow = TerraformNodeProvider(terraform_bin=str(FAKE), workspaces_root=tmp_path / "slow",
                                 check_credentials=False, timeout_s=2)
    with pytest.raises(TerraformError, match="apply timed out after 2s"):
        slow.provision(3, _spec(instance_type="fake.hang-apply"))


def test_release_of_a_run_that_never_started_does_nothing(provider, tmp_path):
    provider.release(99)
    assert _calls(tmp_path) == []


def test_destroy_failure_is_reported(provider):
    provider.provision(9, _spec(instance_type="fake.fail-destroy", node_count=1))
    with pytest.raises(TerraformError, match="DependencyViolation"):
        provider.release(9)


def test_provider_is_picked_by_name():
    assert get_provider("terraform").name == "terraform"
    assert get_provider("local").name == "local"
    with pytest.raises(ValueError, match="unknown node provider"):
        get_provider("gcp-magic")
