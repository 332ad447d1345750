"""Infrastructure fields of a run spec are for site administrators: a member (even the owner of
the project, which any user can create) gets a 403 naming each field; an administrator may."""

from __future__ import annotations

import pytest

from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    api,
    dataset_version,
    project,
    reward_version,
)

pytestmark = pytest.mark.django_db


def _create(api, project, dataset_version, reward_version, spec):  # noqa: F811
    return api.post("/api/runs/", {"project": project.id, "name": "r", "spec": spec,
                                   "dataset_version": dataset_version.id,
                                   "reward_version": reward_version.id}, format="json")


@pytest.mark.parametrize("spec,field", [
    ({"orchestration": {"provider": "terraform"}}, "orchestration.provider"),
    ({"orchestration": {"provider": "static"}}, "orchestration.provider"),
    ({"orchestration": {"terraform_vars": {
        "region": "us-east-1", "availability_zone": "us-east-1a", "instance_type": "p5.48xlarge",
        "node_count": 64, "prefect_api_url": "https://prefect.example/api",
        "ssh_allowed_cidrs": ["0.0.0.0/0"]}}}, "orchestration.terraform_vars"),
    ({"rollout": {"server_urls": ["http://10.0.0.9:30000"]}}, "rollout.server_urls"),
    ({"model": {"path": "/etc"}}, "model.path"),
    ({"rollout": {"workflow": "os:system"}}, "rollout.workflow"),
    ({"reward": {"remote_backend": "subprocess:Popen"}}, "reward.remote_backend"),
    ({"run_dir": "/var/lib/postgresql"}, "run_dir"),
])
def test_a_member_cannot_set_an_infrastructure_field(  # noqa: F811
        api, project, dataset_version, reward_version, spec, field):  # noqa: F811
    from webapp.runs.models import Run

    resp = _create(api, project, dataset_version, reward_version, spec)
    assert resp.status_code == 403, resp.json()
    assert {"field": f"spec.{field}", "message": "administrators only"} in resp.json()["errors"]
    assert not Run.objects.exists(), "nothing created, nothing submitted"


def test_members_use_what_is_registered_and_an_administrator_may_set_the_rest(
        api, alice, project, dataset_version, reward_version):  # noqa: F811
    ok = _create(api, project, dataset_version, reward_version,
                 {"model": {"path": "smollm2"}, "rollout": {"workflow": "multi_turn"},
                  "orchestration": {"placement": {"trainer_nodes": 1}}})
    assert ok.status_code == 201, ok.json()
    alice.is_staff = True
    alice.save()
    admin = _create(api, project, dataset_version, reward_version,
                    {"orchestration": {"provider": "static"},
                     "rollout": {"server_urls": ["http://127.0.0.2:30000"]}})
    assert admin.status_code == 201, admin.json()
