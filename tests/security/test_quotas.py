"""Issue 27, part 5: members run within per-project maxima that administrators set; prompt
templates name row fields and nothing more."""

from __future__ import annotations

import pytest

from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    api,
    bob,
    client_for,
    dataset_version,
    project,
    reward_version,
)

pytestmark = pytest.mark.django_db


def _create(api, project, dataset_version, reward_version, spec):  # noqa: F811
    return api.post("/api/runs/", {"project": project.id, "name": "q", "spec": spec,
                                   "dataset_version": dataset_version.id,
                                   "reward_version": reward_version.id}, format="json")


@pytest.mark.parametrize("spec,field,maximum", [
    ({"rollout": {"num_servers": 500}}, "spec.rollout.num_servers", 4),
    ({"reward": {"workers": 500}}, "spec.reward.workers", 8),
    ({"rollout": {"max_concurrent": 100_000}}, "spec.rollout.max_concurrent", 1024),
    ({"rollout": {"max_new_tokens": 1_000_000}}, "spec.rollout.max_new_tokens", 4096),
    ({"trainer": {"steps": 10**12}}, "spec.trainer.steps", 100_000),
    ({"model": {"hidden_size": 8192, "num_layers": 64}}, "spec.model.hidden_size", 50_000_000),
])
def test_a_fresh_project_refuses_resources_over_the_defaults(
        api, project, dataset_version, reward_version, spec, field, maximum):  # noqa: F811
    from webapp.runs.models import Run

    r = _create(api, project, dataset_version, reward_version, spec)
    assert r.status_code == 403, r.content
    error = r.json()["errors"][0]
    assert error["field"] == field and error["maximum"] == maximum
    assert f"{maximum:,}" in error["message"] and not Run.objects.exists()


def test_every_field_over_the_quota_is_named(api, project, dataset_version, reward_version):  # noqa: F811
    r = _create(api, project, dataset_version, reward_version,
                {"rollout": {"num_servers": 500, "max_concurrent": 100_000}, "reward": {"workers": 99}})
    assert r.status_code == 403
    assert {e["field"] for e in r.json()["errors"]} == {
        "spec.rollout.num_servers", "spec.rollout.max_concurrent", "spec.reward.workers"}


def test_within_the_quota_is_accepted(api, project, dataset_version, reward_version):  # noqa: F811
    r = _create(api, project, dataset_version, reward_version,
                {"rollout": {"num_servers": 4, "max_concurrent": 1024}, "reward": {"workers": 8},
                 "model": {"hidden_size": 256, "num_layers": 8}, "trainer": {"steps": 100_000}})
    assert r.status_code == 201, r.content


def test_an_administrator_sets_a_projects_maxima(api, project, dataset_version, reward_version):  # noqa: F811
    from webapp.accounts.models import ProjectQuota

    ProjectQuota.objects.create(project=project, max_servers=600, max_steps=10)
    assert _create(api, project, dataset_version, reward_version,
                   {"rollout": {"num_servers": 500}, "trainer": {"steps": 10}}).status_code == 201
    r = _create(api, project, dataset_version, reward_version, {"trainer": {"steps": 11}})
    assert r.status_code == 403 and r.json()["errors"][0] == {
        "field": "spec.trainer.steps", "maximum": 10,
        "message": "11 is over this project's maximum of 10 (max_steps); ask an administrator "
                   "to raise it"}
    # Fields the administrator left empty keep the site default.
    r = _create(api, project, dataset_version, reward_version, {"reward": {"workers": 500},
                                                                "trainer": {"steps": 5}})
    assert r.status_code == 403 and r.json()["errors"][0]["maximum"] == 8


def test_site_administrators_are_not_bound(alice, project, dataset_version, reward_version):  # noqa: F811
    alice.is_staff = True
    alice.save()
    r = _create(client_for(alice), project, dataset_version, reward_version,
                {"rollout": {"num_servers": 500}})
    assert r.status_code == 201, r.content


def test_a_sweep_over_the_quota_creates_nothing(api, project, dataset_version, reward_version):  # noqa: F811
    from webapp.runs.models import Run
    from webapp.sweeps.models import Sweep

    r = api.post("/api/sweeps/", {"project": project.id, "name": "s",
                                  "dataset_version": dataset_version.id,
                                  "reward_version": reward_version.id, "spec": {},
                                  "axes": [{"field": "rollout.num_servers", "values": [1, 500]}]},
                 format="json")
    assert r.status_code == 403, r.content
    assert r.json()["errors"][0]["field"] == "spec.rollout.num_servers"
    assert not Run.objects.exists() and not Sweep.objects.exists()


@pytest.mark.parametrize("template", ["{question:>2000000000}", "{question!r}", "{question.__class__}",
                                      "{question[0]}", "{}", "{0}", "{question"])
def test_prompt_templates_name_plain_fields_only(api, project, dataset_version, reward_version,  # noqa: F811
                                                 template):
    r = _create(api, project, dataset_version, reward_version, {"data": {"prompt_template": template}})
    assert r.status_code == 400, r.content
    assert r.json()["errors"][0]["field"] == "spec.data.prompt_template"


def test_plain_prompt_templates_are_accepted(api, project, dataset_version, reward_version):  # noqa: F811
    r = _create(api, project, dataset_version, reward_version,
                {"data": {"prompt_template": "Q: {question}\nA ({{literal}}):"}})
    assert r.status_code == 201, r.content


def test_members_read_the_quota_and_only_administrators_set_it(
        api, alice, bob, project, dataset_version, reward_version):  # noqa: F811
    r = api.get(f"/api/projects/{project.id}/quota/")
    assert r.status_code == 200 and r.json()["max_servers"] == 4 and r.json()["custom"] == []
    r = api.put(f"/api/projects/{project.id}/quota/", {"max_servers": 600}, format="json")
    assert r.status_code == 403  # the project's owner is a member, not an administrator
    assert client_for(bob).get(f"/api/projects/{project.id}/quota/").status_code == 404
    alice.is_staff = True
    alice.save()
    admin = client_for(alice)
    r = admin.put(f"/api/projects/{project.id}/quota/", {"max_servers": 600, "max_steps": 10},
                  format="json")
    assert r.status_code == 200 and r.json()["max_servers"] == 600
    assert sorted(r.json()["custom"]) == ["max_servers", "max_steps"]
    bad = admin.put(f"/api/projects/{project.id}/quota/", {"max_servers": 0}, format="json")
    assert bad.status_code == 400 and bad.json()["errors"][0]["field"] == "max_servers"
    alice.is_staff = False
    alice.save()
    member = client_for(alice)
    assert _create(member, project, dataset_version, reward_version,
                   {"rollout": {"num_servers": 500}, "trainer": {"steps": 10}}).status_code == 201
    alice.is_staff = True
    alice.save()
    r = admin.put(f"/api/projects/{project.id}/quota/", {"max_servers": None}, format="json")
    assert r.status_code == 200 and r.json()["max_servers"] == 4 and r.json()["custom"] == ["max_steps"]
