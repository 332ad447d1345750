"""Online mode on the web side: a run with rollout.mode: online gets a run key from the web app,
its trainer gets that key with the spec, and its members see the gateway's URL (once the trainer
announces it) and the key on the run page and in the API."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tests.webapp.conftest import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def online_run(project, alice, dataset_version, reward_version):
    from webapp.runs.services import run_create

    return run_create(project=project, user=alice, name="online", dataset_version=dataset_version,
                      reward_version=reward_version, spec={"rollout": {"mode": "online"}})


def _ingest_client(run) -> APIClient:
    from webapp.runs.services import run_token_issue

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {run_token_issue(run=run, purpose='test')}")
    return c


def test_an_online_run_gets_a_key_and_its_members_see_url_and_key(online_run, run, api, client,
                                                                  alice):
    detail = api.get(f"/api/runs/{online_run.id}/").json()
    key = detail["gateway"]["run_key"]
    assert len(key) >= 32 and detail["gateway"]["url"] is None  # no trainer yet
    assert api.get(f"/api/runs/{run.id}/").json()["gateway"] is None  # not an online run
    # The trainer gets the key with the spec; it announces its gateway's URL as an event.
    trainer = _ingest_client(online_run)
    assert trainer.get("/api/ingest/run/").json()["gateway_key"] == key
    assert _ingest_client(run).get("/api/ingest/run/").json()["gateway_key"] == ""
    event = {"kind": "gateway", "message": "online gateway at http://10.0.0.5:41234",
             "data": {"url": "http://10.0.0.5:41234"}}
    assert trainer.post("/api/ingest/events/", {"events": [event]}, format="json").status_code == 200
    assert api.get(f"/api/runs/{online_run.id}/").json()["gateway"] == {
        "url": "http://10.0.0.5:41234", "run_key": key}
    client.force_login(alice)
    page = client.get(f"/runs/{online_run.id}/").content.decode()
    assert 'id="gateway"' in page and key in page and "http://10.0.0.5:41234" in page
    # How to point an agent at it: the URL's /v1 with the run key, rewards by answer id.
    assert 'base_url="http://10.0.0.5:41234/v1"' in page and "/rl/reward" in page
    assert 'id="gateway"' not in client.get(f"/runs/{run.id}/").content.decode()


def test_each_online_run_has_its_own_key_and_other_users_see_none(online_run, project, alice,
                                                                  dataset_version, reward_version,
                                                                  bob):
    from webapp.runs.services import run_create

    other = run_create(project=project, user=alice, name="online 2",
                       dataset_version=dataset_version, reward_version=reward_version,
                       spec={"rollout": {"mode": "online"}})
    assert other.gateway_key and other.gateway_key != online_run.gateway_key
    resp = client_for(bob).get(f"/api/runs/{online_run.id}/")
    assert resp.status_code == 404 and online_run.gateway_key not in resp.content.decode()


def test_the_trainers_spec_carries_the_issued_key(online_run, live_server, tmp_path):
    from training_core.remote_run import prepare_remote_run
    from webapp.runs.services import run_token_issue

    token = run_token_issue(run=online_run, purpose="test")
    spec, path = prepare_remote_run(live_server.url, token, tmp_path / "run")
    assert spec.rollout.mode == "online"
    assert spec.rollout.agent.gateway_key == online_run.gateway_key
    assert online_run.gateway_key in path.read_text()  # the trainer's own spec file (run dir)
