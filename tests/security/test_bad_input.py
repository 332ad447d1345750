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
    # A step of 1.5 was once stored as step 1.
    ("/api/ingest/metrics/", {"points": [{"key": "loss", "step": 1, "value": 1},
                                         {"key": "loss", "step": 1.5, "value": 1}]}, "points[1].step"),
    ("/api/ingest/metrics/", {"points": [{"key": "loss", "step": 1, "value": 1}, 7]}, "points[1]"),
    ("/api/ingest/metrics/", {"points": [{"key": "loss", "step": 1, "value": 1, "time": "x"}]},
     "points[0].time"),
    ("/api/ingest/trajectories/", {"samples": [{"step": BIG, "prompt": "p", "completion": "c",
                                                "reward": 1}]}, "samples[0].step"),
    ("/api/ingest/trajectories/", {"samples": [{"step": 1, "index": BIG, "prompt": "p",
                                                "completion": "c", "reward": 1}]}, "samples[0].index"),
    ("/api/ingest/checkpoints/", {"step": BIG, "version": 1, "path": "/c"}, "step"),
    ("/api/ingest/checkpoints/", {"step": 1, "version": BIG, "path": "/c"}, "version"),
    ("/api/ingest/events/", {"events": [{"message": "m", "data": {"a": "x\x00y"}}]},
     "events[0].data.a"),
    ("/api/ingest/events/", {"events": [{"message": "m", "dedup_key": {"a": 1}}]},
     "events[0].dedup_key"),
    ("/api/ingest/events/", {"events": [{"message": "m\x00"}]}, "events[0].message"),
    ("/api/ingest/metrics/", {"points": [{"key": "lo\x00ss", "step": 1, "value": 1}]},
     "points[0].key"),
    ("/api/ingest/trajectories/", {"samples": [{"step": 1, "prompt": "p", "completion": "c\x00",
                                                "reward": 1}]}, "samples[0].completion"),
    ("/api/ingest/trajectories/", {"samples": [{"step": 1, "prompt": "p", "completion": "c",
                                                "reward": 1, "info": {"t": [1.5, "\x00"]}}]},
     "samples[0].info.t[1]"),
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


def test_a_reward_of_infinity_is_a_400_not_an_unreadable_run(ingest, api, run):  # noqa: F811
    body = ('{"samples": [{"step": 1, "prompt": "p", "completion": "c", "reward": 1e999}]}')
    resp = ingest.post("/api/ingest/trajectories/", body, content_type="application/json")
    assert resp.status_code == 400 and resp.json()["errors"][0]["field"] == "samples[0].reward"
    assert api.get(f"/api/runs/{run.id}/trajectories/").status_code == 200


def test_run_spec_with_nul_or_deep_nesting_is_a_400(api, project, dataset_version, reward_version):  # noqa: F811
    deep: dict = {}
    node = deep
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    for spec, field in (({"trainer": {"name": "a\x00"}}, "spec.trainer.name"),
                        ({"notes": deep}, "spec.notes.x")):
        resp = api.post("/api/runs/", {"project": project.id, "name": "x",
                                       "dataset_version": dataset_version.id,
                                       "reward_version": reward_version.id, "spec": spec},
                        format="json")
        assert resp.status_code == 400, resp.content
        assert resp.json()["errors"][0]["field"].startswith(field)


@pytest.mark.parametrize("query,field", [
    ("after=x", "after"), ("step=x", "step"), (f"after={BIG}", "after"), ("step=-1", "step")])
def test_bad_query_parameters_are_400s(api, run, query, field):  # noqa: F811
    kind = "events" if field == "after" else "trajectories"
    resp = api.get(f"/api/runs/{run.id}/{kind}/?{query}")
    assert resp.status_code == 400 and field in resp.json()["errors"][0]["field"]


@pytest.mark.parametrize("url,field", [
    (f"/api/runs/?project={BIG}", "project"), (f"/api/datasets/?project={BIG * 10}", "project"),
    (f"/api/rewards/?project={BIG}", "project"),
    ("/api/runs/compare/?ids=" + ",".join(str(i) for i in range(1, 30)), "ids"),
    ("/api/runs/compare/?ids=1,99999999999999999999", "ids")])
def test_list_parameters_are_bounded(api, url, field):  # noqa: F811
    resp = api.get(url)
    assert resp.status_code == 400 and resp.json()["errors"][0]["field"] == field


def test_too_many_metric_keys_is_a_400(api, run):  # noqa: F811
    keys = ",".join(f"k{i}" for i in range(200))
    resp = api.get(f"/api/runs/{run.id}/metrics/?keys={keys}")
    assert resp.status_code == 400 and resp.json()["errors"][0]["field"] == "keys"


@pytest.mark.parametrize("path", ["/api/runs/{}/", "/api/runs/{}/events/", "/api/datasets/{}/",
                                  "/api/rewards/{}/", "/runs/{}/"])
def test_ids_beyond_64_bits_are_404s(api, alice, client, path):  # noqa: F811
    client.force_login(alice)
    c = client if not path.startswith("/api/") else api
    assert c.get(path.format("9" * 30)).status_code == 404


def test_reward_source_nested_too_deeply_is_a_400(api, project):  # noqa: F811
    source = "def reward(completion, item):\n    return " + "(" * 300_000 + ")" * 300_000 + "\n"
    resp = api.post("/api/rewards/", {"project": project.id, "name": "deep", "source": source},
                    format="json")
    assert resp.status_code == 400 and resp.json()["errors"][0]["field"] == "source"


@pytest.mark.parametrize("filename,make,fragment", [
    ("extra.csv", lambda: b"question,answer\n1+1,2,surplus\n", "more field"),
    ("nul.jsonl", lambda: b'{"question": "a\\u0000", "answer": "1"}\n', "NUL"),
    ("nan.jsonl", lambda: b'{"question": "q", "answer": "1", "w": NaN}\n', "finite"),
])
def test_bad_dataset_rows_are_row_errors(api, project, filename, make, fragment):  # noqa: F811
    resp = api.post("/api/datasets/", {"project": project.id, "name": "d", "task": "qa",
                                       "file": _file(filename, make())}, format="multipart")
    assert resp.status_code == 400, resp.content
    assert fragment in resp.json()["errors"][0]["message"] and resp.json()["errors"][0]["line"] == 2 - filename.endswith("jsonl")


def test_parquet_timestamp_and_bytes_columns_are_row_errors(api, project):  # noqa: F811
    import datetime
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({"question": ["q"], "answer": ["1"],
                             "at": [datetime.datetime(2026, 1, 1)], "raw": [b"\x00\x01"]}), out)
    resp = api.post("/api/datasets/", {"project": project.id, "name": "d", "task": "qa",
                                       "file": _file("t.parquet", out.getvalue())}, format="multipart")
    assert resp.status_code == 400, resp.content
    assert resp.json()["errors"][0]["field"] in ("at", "raw")


def _file(name: str, data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile(name, data)


def test_project_slugs_leak_nothing_when_derived(api, alice):  # noqa: F811
    from webapp.accounts.services import project_create, user_create

    mallory = user_create(username="mallory", password="mallory-pass-123")
    project_create(user=mallory, name="Secret lab")
    resp = api.post("/api/projects/", {"name": "Secret lab"}, format="json")
    assert resp.status_code == 201 and resp.json()["slug"] == "secret-lab-2"
    taken = api.post("/api/projects/", {"name": "Mine", "slug": "secret-lab"}, format="json")
    assert taken.status_code == 409 and taken.json()["errors"][0]["field"] == "slug"


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
