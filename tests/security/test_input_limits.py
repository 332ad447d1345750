"""Issue 27, part 6: the 500s found by hand are 4xx naming the field; JSON 404s in every setting;
uploads do not amplify; production settings are HTTPS-only."""

from __future__ import annotations

import io
import json

import pytest
from django.test import Client
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
DEEP_JSON = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def ingest(run):  # noqa: F811
    from webapp.runs.services import run_token_issue

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {run_token_issue(run=run, purpose='test')}")
    return client


@pytest.mark.parametrize("body", [DEEP_JSON, '{"a": ' * 65 + "1" + "}" * 65,
                                  '{"username": ' + "[" * 3000 + "]" * 3000 + "}"])
def test_deep_json_to_the_unauthenticated_token_endpoint_is_a_400(body):
    r = APIClient().post("/api/auth/token/", body, content_type="application/json")
    assert r.status_code == 400, r.content[:300]
    assert "nested deeper than 64" in r.json()["message"]


def test_deep_json_is_a_400_on_user_and_ingest_endpoints(api, ingest):  # noqa: F811
    for client, path in ((api, "/api/runs/"), (api, "/api/runs/spec-check/"),
                         (api, "/api/projects/"), (ingest, "/api/ingest/metrics/"),
                         (ingest, "/api/ingest/events/")):
        r = client.post(path, DEEP_JSON, content_type="application/json")
        assert r.status_code == 400, (path, r.content[:300])
        assert "nested deeper" in r.json()["message"]


def test_json_at_the_depth_limit_is_parsed_and_checked_per_field(api):  # noqa: F811
    # 64 levels is a well-formed body; the spec inside is then refused by its own, tighter rule
    # with the path of the bad part.
    deep = "[" * 60 + "]" * 60
    r = api.post("/api/runs/spec-check/", f'{{"spec": {{"notes": {deep}}}}}',
                 content_type="application/json")
    assert r.status_code == 400 and r.json()["errors"][0]["field"].startswith("spec.notes")


@pytest.mark.parametrize("text,fragment", [
    ("notes: " + "[" * 40_000 + "]" * 40_000, "nested deeper than 32"),
    ("notes:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 60)) + " " * 60 + "x\n",
     "nested deeper than 32"),
    ("notes: !!binary aGVsbG8=", "!!binary"),
    ("notes: !!python/object/apply:os.system [id]", "!!python"),
    ("notes: !!timestamp 2024-01-01", "!!timestamp"),
    ("notes: !!set {a}", "!!set"),
    ("notes: .nan", "finite"),
    ("1: x", "keys must be text"),
])
def test_bad_yaml_in_spec_check_is_an_error_naming_the_yaml_field(api, text, fragment):  # noqa: F811
    r = api.post("/api/runs/spec-check/", {"yaml": text}, format="json")
    assert r.status_code == 200, r.content[:300]  # spec-check's verdict: valid false, per field
    body = r.json()
    assert body["valid"] is False and body["errors"][0]["field"] == "yaml"
    assert fragment in body["errors"][0]["message"], body["errors"]


def test_yaml_dates_are_text_as_in_json(api):  # noqa: F811
    r = api.post("/api/runs/spec-check/", {"yaml": "trainer:\n  steps: 3\nnotes: 2024-01-01\n"},
                 format="json")
    assert r.status_code == 200 and r.json()["spec"]["notes"] == "2024-01-01", r.json()


def _run_form(project, dataset_version, reward_version, spec: str, **extra):  # noqa: F811
    return {"project": project.id, "name": "f", "dataset_version": dataset_version.id,
            "reward_version": reward_version.id, "spec": spec, **extra}


@pytest.mark.parametrize("spec,fragment", [
    ("notes: " + "[" * 40_000 + "]" * 40_000, "nested deeper"),
    ("notes: !!binary aGVsbG8=", "!!binary")])
def test_bad_yaml_in_the_run_form_is_a_400_next_to_the_field(
        client, alice, project, dataset_version, reward_version, spec, fragment):  # noqa: F811
    client.force_login(alice)
    r = client.post("/runs/new/", _run_form(project, dataset_version, reward_version, spec))
    assert r.status_code == 400 and fragment in r.content.decode()
    from webapp.runs.models import Run

    assert not Run.objects.filter(name="f").exists()


def test_a_yaml_date_in_a_sweep_base_spec_is_stored_as_text(
        client, alice, project, dataset_version, reward_version):  # noqa: F811
    from webapp.sweeps.models import Sweep

    client.force_login(alice)
    r = client.post("/runs/new/", _run_form(project, dataset_version, reward_version,
                                            "trainer:\n  steps: 3\nname: 2024-01-01\n",
                                            sweep_field_1="trainer.lr",
                                            sweep_values_1="1e-4,2e-4"))
    assert r.status_code == 302, r.content.decode()[-2000:]
    sweep = Sweep.objects.get()
    assert sweep.runs.count() == 2
    assert sweep.base_spec["name"] == "2024-01-01"  # text: a date was a 500 when stored


@pytest.mark.parametrize("value", ["²", "١٢", "99999999999999999999", "9223372036854775808"])
def test_dashboard_numbers_are_ascii_and_64_bit(client, alice, project, dataset_version,  # noqa: F811
                                                reward_version, value):  # noqa: F811
    client.force_login(alice)
    r = client.post("/runs/new/", {**_run_form(project, dataset_version, reward_version,
                                               "trainer:\n  steps: 3\n"), "project": value})
    assert r.status_code == 400 and "digits 0-9" in r.content.decode()
    r = client.get(f"/compare/?ids={value}")
    assert r.status_code == 200 and "digits 0-9" in r.content.decode()
    r = client.get(f"/compare/?id_list=1,{value}")
    assert r.status_code == 200 and "digits 0-9" in r.content.decode()
    assert client.get(f"/?project={value}").status_code == 200  # a bad filter shows everything
    assert client.get(f"/runs/new/?clone={value}").status_code == 200


@pytest.mark.parametrize("query", ["²", "١٢", "+1", " 1", "1_0", "9223372036854775808"])
def test_api_query_numbers_are_ascii_and_64_bit(api, run, query):  # noqa: F811
    r = api.get(f"/api/runs/?project={query}")
    assert r.status_code == 400 and r.json()["errors"][0]["field"] == "project"
    r = api.get(f"/api/runs/{run.id}/events/?after={query}")
    assert r.status_code == 400 and r.json()["errors"][0]["field"] == "after"


@pytest.mark.parametrize("debug", [False, True])
def test_unmatched_api_paths_are_json_404s_in_every_setting(api, alice, settings, debug):  # noqa: F811
    settings.DEBUG = debug
    for method, path in (("get", "/api/nothing-here/"), ("get", "/api/runs/abc/"),
                         ("post", "/api/nothing/"), ("delete", "/api/runs/1/x/y/"),
                         ("get", "/api/dataset-versions/\u00ec:\n\u00cd/")):
        r = getattr(api, method)(path)
        assert r.status_code == 404 and r["Content-Type"] == "application/json", (path, r.content)
        assert path.replace("\n", "") in r.json()["errors"][0]["message"]
    # A POST with a session (CSRF applies) but no endpoint is a 404 too, not a CSRF 403.
    from django.test import Client

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(alice)
    r = browser.post("/api/runs/abc/cancel/")
    assert r.status_code == 404 and r["Content-Type"] == "application/json"
    # Without its final slash, even a POST (which APPEND_SLASH cannot redirect) is told the URL.
    r = api.post("/api/runs", {}, format="json")
    assert r.status_code == 404 and "/api/runs/ (with the final slash)" in r.json()["errors"][0]["message"]


def _parquet(rows: int, cell_bytes: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({"question": ["q" * cell_bytes] * rows, "answer": ["1"] * rows}),
                   out, compression="zstd")
    return out.getvalue()


def test_a_small_parquet_of_huge_cells_is_refused_with_a_small_answer(api, project):  # noqa: F811
    from django.core.files.uploadedfile import SimpleUploadedFile

    from webapp.datasets.models import DatasetVersion

    data = _parquet(40, 1 << 20)
    assert len(data) < 10_000  # the issue's file: a few kB that expand to 40 MiB
    r = api.post("/api/datasets/", {"project": project.id, "name": "bomb", "task": "qa",
                                    "file": SimpleUploadedFile("b.parquet", data)}, format="multipart")
    assert r.status_code == 400 and len(r.content) < 50_000, len(r.content)
    assert r.json()["errors"][0]["field"] == "question"
    assert "OOLONG_DATASET_MAX_CELL_CHARS" in r.json()["errors"][0]["message"]
    assert not DatasetVersion.objects.exists()


def test_big_cells_under_the_cap_are_stored_with_a_capped_preview(api, project, settings):  # noqa: F811
    from django.core.files.uploadedfile import SimpleUploadedFile

    from webapp.datasets.models import DatasetVersion
    from webapp.datasets.selectors import dataset_version_rows

    data = _parquet(40, 100_000)
    r = api.post("/api/datasets/", {"project": project.id, "name": "big", "task": "qa",
                                    "file": SimpleUploadedFile("b.parquet", data)}, format="multipart")
    assert r.status_code == 201, r.content[:500]
    assert len(r.content) < 50_000, len(r.content)
    version = DatasetVersion.objects.get()
    assert version.row_count == 40
    assert len(json.dumps(version.preview)) + len(json.dumps(version.stats)) < 50_000
    assert version.preview[0]["question"].endswith("…") and len(version.preview[0]["question"]) == 501
    # The full rows are in the file the parse child wrote, nothing cut.
    rows = list(dataset_version_rows(version=version))
    assert len(rows) == 40 and rows[0]["question"] == "q" * 100_000
    detail = api.get(f"/api/dataset-versions/{version.id}/")
    assert detail.status_code == 200 and len(detail.content) < 50_000


def test_the_web_process_never_holds_the_rows(monkeypatch, project, alice):  # noqa: F811
    """The parse child writes the rows: what comes back to the web process is the summary."""
    from webapp.datasets import services, validation

    seen = {}
    real = validation.validate_upload_bounded

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        seen["result"] = result
        return result

    monkeypatch.setattr(services, "validate_upload_bounded", spy)
    rows = "".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                   for i in range(500)).encode()
    version = services.dataset_upload(project=project, user=alice, name="d", task="qa",
                                      filename="d.jsonl", data=rows)
    assert seen["result"].rows == [] and seen["result"].summary["row_count"] == 500
    assert version.row_count == 500 and len(version.preview) == 20


def test_production_is_https_only_and_needs_a_shared_cache(tmp_path):
    code = ("from django.conf import settings as s; print(s.SECURE_SSL_REDIRECT, "
            "s.SECURE_HSTS_SECONDS, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE)")
    env = {"OOLONG_DATA_DIR": str(tmp_path), "DJANGO_SECRET_KEY": "k" * 50}
    r = _settings_process("webapp.config.settings.production",
                          {**env, "DJANGO_CACHE_URL": "redis://127.0.0.1:6379/5"}, code)
    assert r.returncode == 0, r.stderr[-800:]
    redirect, hsts, session, csrf = r.stdout.split()
    assert redirect == session == csrf == "True" and int(hsts) >= 180 * 24 * 3600
    r = _settings_process("webapp.config.settings.production", env, code)
    assert r.returncode != 0 and "DJANGO_CACHE_URL is not set" in r.stderr


def test_production_redirects_plain_http_and_sends_hsts(settings, alice):  # noqa: F811
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_HSTS_SECONDS = 31_536_000
    r = Client().get("/api/projects/")
    assert r.status_code == 301 and r["Location"].startswith("https://")
    r = Client().get("/api/projects/", secure=True)
    assert r["Strict-Transport-Security"].startswith("max-age=31536000")
