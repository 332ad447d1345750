"""Issue 47.1 through the web app: a member can neither name the online gateway's file (no such
field: a 400 naming it) nor choose where it listens or how it is advertised (administrator
fields: a 403 naming each)."""

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


def _create(api, project, dataset_version, reward_version, agent):  # noqa: F811
    return api.post("/api/runs/", {"project": project.id, "name": "r",
                                   "spec": {"rollout": {"mode": "online", "agent": agent}},
                                   "dataset_version": dataset_version.id,
                                   "reward_version": reward_version.id}, format="json")


@pytest.mark.parametrize("agent,field", [
    ({"gateway_host": "0.0.0.0"}, "rollout.agent.gateway_host"),
    ({"gateway_port": 22}, "rollout.agent.gateway_port"),
    ({"public_url": "https://evil.example"}, "rollout.agent.public_url"),
])
def test_where_the_gateway_listens_is_for_administrators(  # noqa: F811
        api, project, dataset_version, reward_version, agent, field):  # noqa: F811
    from webapp.runs.models import Run

    resp = _create(api, project, dataset_version, reward_version, agent)
    assert resp.status_code == 403, resp.json()
    assert {"field": f"spec.{field}", "message": "administrators only"} in resp.json()["errors"]
    assert not Run.objects.exists()


def test_no_field_names_the_gateway_file(  # noqa: F811
        api, project, dataset_version, reward_version):  # noqa: F811
    from webapp.runs.models import Run

    resp = _create(api, project, dataset_version, reward_version,
                   {"gateway_file": "/etc/cron.d/x"})
    assert resp.status_code == 400, resp.json()
    assert "rollout.agent.gateway_file" in str(resp.json())
    assert not Run.objects.exists()
