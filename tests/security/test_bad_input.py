"""Bad input from the issue's list is a 400 that names the field, never a 500."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    api,
    dataset_version,
    project,
    reward_version,
    run,
)

pytestmark = pytest.mark.django_db
BIG = 2**63


@pytest.fixture
def ingest(run):  # noqa: F811
    from webapp.runs.services import run_token_issue

    ingest_token = run_token_issue(run=run, purpose="test")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {ingest_token}")
    return client


@pytest.mark.parametrize("path,body,field", [
    ("/api/ingest/metrics/", {"points": [{"key": "loss", "step": BIG, "value": 1}]}, "points[0].step"),
    ("/api/ingest/metrics/", {"points": [{"key": "loss", "step": 1, "value": 1, "time": "x"}]},
     "points[0].time"),
    ("/api/ingest/trajectories/", {"samples": [{"step": BIG, "prompt": "p", "completion": "c",
                                                "reward": 1}]}, "samples[0].step"),
    ("/api/ingest/trajectories/", {"samples": [{"step": 1, "index": BIG, "prompt": "p",
                                                "completion": "c", "reward": 1}]}, "samples[0].index"),
    ("/api/ingest/checkpoints/", {"step": BIG, "version": 1, "path": "/c"}, "step"),
    ("/api/ingest/checkpoints/", {"step": 1, "version": BIG, "path": "/c"}, "version"),
])
def test_ingest_bad_numbers_are_400s_naming_the_field(ingest, path, body, field):
    resp = ingest.post(path, body, format="json")
    assert resp.status_code == 400, resp.content
    assert field in [e["field"] for e in resp.json()["errors"]], resp.json()


def test_run_create_with_a_non_object_spec_is_a_400(api, project, dataset_version, reward_version):  # noqa: F811
    resp = api.post("/api/runs/", {"project": project.id, "name": "x",
                                   "dataset_version": dataset_version.id,
                                   "reward_version": reward_version.id, "spec": [1, 2]},
                    format="json")
    assert resp.status_code == 400 and "spec" in [e["field"] for e in resp.json()["errors"]]


@pytest.mark.parametrize("query,field", [("after=x", "after"), ("step=x", "step")])
def test_bad_query_parameters_are_400s(api, run, query, field):  # noqa: F811
    kind = "events" if field == "after" else "trajectories"
    resp = api.get(f"/api/runs/{run.id}/{kind}/?{query}")
    assert resp.status_code == 400 and field in resp.json()["errors"][0]["field"]


def test_tokens_are_stored_hashed_and_refused_once_the_run_ends(run, api):  # noqa: F811
    from webapp.runs.models import RunToken
    from webapp.runs.services import run_status_set, run_token_issue

    token = run_token_issue(run=run, purpose="test")
    assert not RunToken.objects.filter(token_hash=token).exists()  # only the hash is kept
    assert token not in str(list(RunToken.objects.values_list("token_hash", flat=True)))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get("/api/ingest/run/").status_code == 200
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token[:-1]}x")
    assert client.get("/api/ingest/run/").status_code in (401, 403)
    run_status_set(run=run, status="running")
    run_status_set(run=run, status="succeeded")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    refused = client.get("/api/ingest/run/")
    assert refused.status_code in (401, 403)  # a finished run's token is refused
    assert client.post("/api/ingest/metrics/", {"points": [{"key": "x", "step": 1, "value": 1}]},
                       format="json").status_code in (401, 403)
    # The creator's token from the API is issued the same way and shown only in that response.
    created = api.post("/api/runs/", {"project": run.project_id, "name": "again",
                                      "dataset_version": run.dataset_version_id,
                                      "reward_version": run.reward_version_id}, format="json")
    assert created.status_code == 201 and created.json()["ingest_token"]
    assert "ingest_token" not in api.get(f"/api/runs/{created.json()['id']}/").json()
