"""Dataset versions marked as eval sets and attached to runs (issue 48): the flag (upload, web
form, REST API; members of the version's project only), run creation with eval sets (same
project, marked, at most 8; the web app sets the spec's eval.sets and refuses a user's), the
run-scoped ingest of their rows (only the run's own) and the trainer node's download of them."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from tests.webapp.conftest import QA_ROWS, jsonl

pytestmark = pytest.mark.django_db

EVAL_ROWS = [{"question": f"{i}*2=", "answer": str(2 * i)} for i in range(12)]


def _upload(project, user, name: str, rows=EVAL_ROWS, **kwargs):
    from webapp.datasets.services import dataset_upload

    return dataset_upload(project=project, user=user, name=name, task="arithmetic",
                          filename=f"{name}.jsonl", data=jsonl(rows), **kwargs)


@pytest.fixture
def eval_version(project, alice):
    return _upload(project, alice, "Doubles Test", is_eval_set=True)


def _create(api, project, dataset_version, reward_version, **body):
    return api.post("/api/runs/", {"project": project.id, "name": "with evals",
                                   "dataset_version": dataset_version.id,
                                   "reward_version": reward_version.id, **body}, format="json")


def _fields(resp) -> set[str]:
    return {e["field"] for e in resp.json()["errors"]}


def test_a_version_is_marked_at_upload_and_later_by_members_only(api, bob_api, project, alice,
                                                                 dataset_version):
    assert not dataset_version.is_eval_set
    assert _upload(project, alice, "evals", is_eval_set=True).is_eval_set
    url = f"/api/dataset-versions/{dataset_version.id}/"
    assert api.get(url).json()["is_eval_set"] is False
    resp = api.patch(url, {"is_eval_set": True}, format="json")
    assert resp.status_code == 200 and resp.json()["is_eval_set"] is True
    dataset_version.refresh_from_db()
    assert dataset_version.is_eval_set
    bad = api.patch(url, {"is_eval_set": "perhaps"}, format="json")
    assert bad.status_code == 400 and "is_eval_set" in _fields(bad)
    # Bob is no member of Alice's project: her version does not exist for him.
    assert bob_api.patch(url, {"is_eval_set": False}, format="json").status_code == 404
    dataset_version.refresh_from_db()
    assert dataset_version.is_eval_set


def test_the_upload_api_takes_the_flag(api, project):
    resp = api.post("/api/datasets/", {"project": project.id, "name": "evals", "task": "qa",
                                       "is_eval_set": "true",
                                       "file": _file("evals.jsonl", jsonl(EVAL_ROWS))},
                    format="multipart")
    assert resp.status_code == 201 and resp.json()["is_eval_set"] is True


def _file(name: str, data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile(name, data, content_type="application/jsonl")


def test_eval_set_names_are_slugs_unique_in_the_run_and_never_heldout():
    from webapp.runs.services import eval_set_name

    assert eval_set_name("Doubles Test!", set()) == "doubles-test"
    assert eval_set_name("heldout", set()) == "heldout-2"
    assert eval_set_name("doubles test", {"doubles-test"}) == "doubles-test-2"
    assert eval_set_name("???", set()) == "set"
    long = eval_set_name("x" * 60, {"x" * 40})
    assert long == "x" * 38 + "-2" and len(long) == 40


def test_only_marked_versions_of_the_runs_project_are_attached(api, project, alice, bob,
                                                               bob_project, dataset_version,
                                                               reward_version, eval_version):
    unmarked = _upload(project, alice, "plain")
    resp = _create(api, project, dataset_version, reward_version,
                   eval_set_versions=[unmarked.id])
    assert resp.status_code == 400 and _fields(resp) == {"eval_set_versions"}
    assert "not marked as an eval set" in resp.json()["message"]
    # Another project's version, marked or not, is no version Alice can attach.
    bobs = _upload(bob_project, bob, "bobs", is_eval_set=True)
    resp = _create(api, project, dataset_version, reward_version, eval_set_versions=[bobs.id])
    assert resp.status_code == 400 and _fields(resp) == {"eval_set_versions"}
    assert "not found" in resp.json()["message"]
    # A project of Alice's own, but not the run's.
    from webapp.accounts.services import project_create

    other = project_create(user=alice, name="Alice other lab")
    elsewhere = _upload(other, alice, "elsewhere", is_eval_set=True)
    resp = _create(api, project, dataset_version, reward_version,
                   eval_set_versions=[elsewhere.id])
    assert resp.status_code == 400 and "another project" in resp.json()["message"]
    resp = _create(api, project, dataset_version, reward_version,
                   eval_set_versions=[eval_version.id] * 9)
    assert resp.status_code == 400 and _fields(resp) == {"eval_set_versions"}
    resp = _create(api, project, dataset_version, reward_version,
                   eval_set_versions=[eval_version.id, eval_version.id])
    assert resp.status_code == 400 and "twice" in resp.json()["message"]


def test_a_users_eval_sets_in_the_spec_are_refused(api, project, dataset_version, reward_version):
    spec = {"eval": {"sets": [{"name": "mine", "source": "jsonl:/etc/passwd"}]}}
    resp = _create(api, project, dataset_version, reward_version, spec=spec)
    assert resp.status_code == 400 and _fields(resp) == {"spec.eval.sets"}
    assert "attach eval-set dataset versions" in resp.json()["message"]
    check = api.post("/api/runs/spec-check/", {"spec": spec}, format="json").json()
    assert not check["valid"] and [e["field"] for e in check["errors"]] == ["spec.eval.sets"]


@pytest.fixture
def eval_run(api, project, alice, dataset_version, reward_version, eval_version):
    second = _upload(project, alice, "heldout", rows=EVAL_ROWS[:5], is_eval_set=True)
    resp = _create(api, project, dataset_version, reward_version,
                   eval_set_versions=[eval_version.id, second.id])
    assert resp.status_code == 201, resp.content
    from webapp.runs.models import Run

    return Run.objects.get(id=resp.json()["id"]), second


def test_attached_eval_sets_are_in_the_spec_the_api_and_the_run_page(api, client, alice,
                                                                      eval_run, eval_version):
    run, second = eval_run
    assert run.spec["eval"]["sets"] == [
        {**entry, "name": name, "source": f"jsonl:eval_sets/{name}.jsonl"}
        for entry, name in zip(run.spec["eval"]["sets"], ["doubles-test", "heldout-2"],
                               strict=True)]
    got = api.get(f"/api/runs/{run.id}/").json()["eval_sets"]
    assert got == [{"name": "doubles-test", "dataset_version_id": eval_version.id},
                   {"name": "heldout-2", "dataset_version_id": second.id}]
    client.force_login(alice)
    page = client.get(f"/runs/{run.id}/").content.decode()
    assert 'id="eval-sets-attached"' in page and "doubles-test" in page
    assert 'id="eval-empty" >' in page or 'id="eval-empty">' in page  # no evals yet: shown


def test_a_clone_and_a_sweep_around_a_run_keep_its_eval_sets(client, alice, eval_run,
                                                               eval_version):
    from webapp.runs.selectors import run_spec_overrides
    from webapp.sweeps.services import sweep_against_synchronous

    run, second = eval_run
    assert "sets" not in run_spec_overrides(run=run).get("eval", {})  # the platform's field
    client.force_login(alice)
    form = client.get(f"/runs/new/?clone={run.id}").content.decode()
    picked = form.split('name="eval_set_versions"')[1].split("</select>")[0]
    assert f'<option value="{eval_version.id}" selected' in picked
    assert f'<option value="{second.id}" selected' in picked
    sweep = sweep_against_synchronous(run=run, user=alice)
    for r in sweep.runs.all():
        assert [e.name for e in r.eval_sets.all()] == ["doubles-test", "heldout-2"]
        assert [s["name"] for s in r.spec["eval"]["sets"]] == ["doubles-test", "heldout-2"]


def test_a_member_resumes_a_run_with_eval_sets(eval_run, alice):
    # eval.sets is an administrators' field when a user writes it; the platform's own is not.
    from webapp.runs.models import Run
    from webapp.runs.services import run_resume, run_status_set

    run, _ = eval_run
    assert not alice.is_staff
    run_status_set(run=run, status=Run.Status.FAILED, reason="test")
    assert run_resume(run=run, user=alice).status == Run.Status.QUEUED


def _ingest_client(run) -> APIClient:
    from webapp.runs.services import run_token_issue

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {run_token_issue(run=run, purpose='test')}")
    return c


def test_the_ingest_serves_the_runs_own_eval_sets_only(eval_run, eval_version, run,
                                                       dataset_version):
    attached, _ = eval_run
    trainer = _ingest_client(attached)
    info = trainer.get("/api/ingest/run/").json()
    assert [e["name"] for e in info["eval_sets"]] == ["doubles-test", "heldout-2"]
    resp = trainer.get(f"/api/ingest/eval-sets/{eval_version.id}/")
    assert resp.status_code == 200
    assert [json.loads(line) for line in b"".join(resp.streaming_content).splitlines()] == EVAL_ROWS
    # The training dataset is no eval set of the run; another run has no eval set at all.
    assert trainer.get(f"/api/ingest/eval-sets/{dataset_version.id}/").status_code == 404
    assert _ingest_client(run).get(f"/api/ingest/eval-sets/{eval_version.id}/").status_code == 404
    assert APIClient().get(f"/api/ingest/eval-sets/{eval_version.id}/").status_code == 401


@pytest.mark.django_db(transaction=True)
def test_the_node_downloads_the_eval_sets_and_points_the_spec_at_them(eval_run, live_server,
                                                                      tmp_path):
    from training_core.remote_run import prepare_remote_run
    from webapp.runs.services import run_token_issue

    run, _ = eval_run
    token = run_token_issue(run=run, purpose="test")
    spec, path = prepare_remote_run(live_server.url, token, tmp_path / "run")
    sets = {s.name: s.source for s in spec.eval.sets}
    assert sets == {name: f"jsonl:{tmp_path / 'run' / 'eval_sets' / (name + '.jsonl')}"
                    for name in ("doubles-test", "heldout-2")}
    rows = (tmp_path / "run" / "eval_sets" / "doubles-test.jsonl").read_text().splitlines()
    assert [json.loads(r) for r in rows] == EVAL_ROWS
    assert len((tmp_path / "run" / "eval_sets" / "heldout-2.jsonl").read_text().splitlines()) == 5
    assert str(tmp_path / "run" / "eval_sets") in path.read_text()  # the trainer's spec file


def test_the_web_forms_mark_and_attach(client, alice, project, dataset_version, reward_version,
                                       eval_version):
    client.force_login(alice)
    dataset_id = dataset_version.dataset_id
    page = client.get(f"/datasets/{dataset_id}/").content.decode()
    assert "Mark as eval set" in page
    client.post(f"/datasets/{dataset_id}/eval-set/", {"version": dataset_version.id,
                                                      "is_eval_set": "on"})
    dataset_version.refresh_from_db()
    assert dataset_version.is_eval_set
    client.post(f"/datasets/{dataset_id}/eval-set/", {"version": dataset_version.id})
    dataset_version.refresh_from_db()
    assert not dataset_version.is_eval_set
    # A version of another dataset is not marked through this one's page.
    client.post(f"/datasets/{dataset_id}/eval-set/", {"version": eval_version.id})
    eval_version.refresh_from_db()
    assert eval_version.is_eval_set
    form = client.get("/runs/new/").content.decode()
    assert f'<option value="{eval_version.id}"' in form.split('name="eval_set_versions"')[1]
    resp = client.post("/runs/new/", {"name": "form run", "project": project.id,
                                      "dataset_version": dataset_version.id,
                                      "reward_version": reward_version.id,
                                      "spec": "trainer:\n  steps: 3\n",
                                      "eval_set_versions": [dataset_version.id]})
    assert resp.status_code == 400 and "not marked as an eval set" in resp.content.decode()
    resp = client.post("/runs/new/", {"name": "form run", "project": project.id,
                                      "dataset_version": dataset_version.id,
                                      "reward_version": reward_version.id,
                                      "spec": "trainer:\n  steps: 3\n",
                                      "eval_set_versions": [eval_version.id]})
    assert resp.status_code == 302
    from webapp.runs.models import Run

    run = Run.objects.get(name="form run")
    assert [e.dataset_version_id for e in run.eval_sets.all()] == [eval_version.id]


def test_a_cli_run_takes_eval_set_versions():
    import argparse

    from training_core.runs_cli import add_runs_parser

    parser = argparse.ArgumentParser()
    add_runs_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["runs", "create", "--project", "1", "--dataset-version", "2",
                              "--reward-version", "3", "--eval-set-version", "7",
                              "--eval-set-version", "9"])
    assert args.eval_set_versions == [7, 9]


def test_qa_rows_are_not_eval_rows():  # the fixtures differ: attached rows are the eval set's
    assert {r["question"] for r in QA_ROWS}.isdisjoint(r["question"] for r in EVAL_ROWS)
