"""A run's nodes hold a credential of their own, scoped to that run (issue 46.6, 47.8): only the
run's flow may issue it; with it a node reads its own run's spec and data and no other run's,
through no endpoint. Prefect in server mode must be authenticated and carry no token in a
parameter: production refuses to start without it. (The Prefect side, a node of another run
reading every flow run's parameters, is shown end to end by the simulated-cloud test.)"""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tests.security.test_web_hardening import _settings_process
from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    api,
    dataset_version,
    project,
    reward_version,
    run,
)

pytestmark = pytest.mark.django_db


def _bearer(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def two_runs(project, alice, dataset_version, reward_version):  # noqa: F811
    from webapp.runs.services import run_create, run_token_issue

    runs = [run_create(project=project, user=alice, name=name, dataset_version=dataset_version,
                       reward_version=reward_version, spec={"trainer": {"steps": 5}})
            for name in ("run-a", "run-b")]
    return [(r, run_token_issue(run=r, purpose="orchestrator")) for r in runs]


def test_only_the_runs_flow_issues_its_nodes_credential(two_runs):
    from webapp.runs.services import run_token_issue

    (a, flow_a), _ = two_runs
    issued = _bearer(flow_a).post("/api/ingest/node-credential/")
    assert issued.status_code == 201
    node_a = issued.json()["credential"]
    assert node_a != flow_a
    # a node's credential, the creator's token: no credential of their own to hand out
    for token in (node_a, run_token_issue(run=a, purpose="creator")):
        refused = _bearer(token).post("/api/ingest/node-credential/")
        assert refused.status_code == 403, refused.content
    assert _bearer("forged").post("/api/ingest/node-credential/").status_code == 401


def test_run_bs_node_cannot_read_run_as_spec_through_the_web_app(two_runs, api):  # noqa: F811
    (a, _), (b, flow_b) = two_runs
    node_b = _bearer(_bearer(flow_b).post("/api/ingest/node-credential/").json()["credential"])
    mine = node_b.get("/api/ingest/run/")
    assert mine.status_code == 200 and mine.json()["id"] == b.id
    assert mine.json()["spec"]["name"] == "run-b"
    # every way to run A's spec, its data or its reward code: refused to B's credential
    for path in (f"/api/runs/{a.id}/", f"/api/runs/{a.id}/spec/", f"/api/runs/{a.id}/metrics/",
                 f"/api/runs/{a.id}/trajectories/", f"/api/runs/?project={a.project_id}",
                 f"/api/datasets/{a.dataset_version.dataset_id}/"):
        got = node_b.get(path)
        assert got.status_code in (401, 403, 404), (path, got.status_code)
        assert b"run-a" not in got.content, path
    assert api.get(f"/api/runs/{a.id}/").status_code == 200  # the path exists for its members


def test_a_finished_runs_node_credential_stops_working(two_runs):
    from webapp.runs.services import run_status_set

    (a, flow_a), _ = two_runs
    node_a = _bearer(flow_a).post("/api/ingest/node-credential/").json()["credential"]
    run_status_set(run=a, status="failed", reason="test")
    assert _bearer(node_a).get("/api/ingest/run/").status_code == 401


def test_production_refuses_prefect_server_mode_without_authentication(tmp_path):
    base = {"OOLONG_DATA_DIR": str(tmp_path), "DJANGO_SECRET_KEY": "k" * 50,
            "DJANGO_CACHE_URL": "redis://127.0.0.1:6379/5", "OOLONG_PREFECT_MODE": "server",
            "PREFECT_API_URL": "http://prefect:4200/api"}
    code = "import webapp.config.wsgi"
    r = _settings_process("", base, code)
    assert r.returncode != 0
    assert "needs PREFECT_API_AUTH_STRING, OOLONG_CONTROL_KEY" in r.stderr, r.stderr[-800:]
    ok = _settings_process("", {**base, "PREFECT_API_AUTH_STRING": "oolong:" + "p" * 32,
                                "OOLONG_CONTROL_KEY": "k" * 43 + "="}, code)
    assert ok.returncode == 0, ok.stderr[-800:]
