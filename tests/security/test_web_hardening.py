"""Web hardening: login throttling, password rules, production defaults, body size caps."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from tests.webapp.conftest import alice, api, project  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_counts(settings):
    settings.LOGIN_FAILURE_LIMIT = 3
    cache.clear()
    yield
    cache.clear()


def test_login_page_blocks_a_username_at_an_address_after_failed_attempts(alice):  # noqa: F811
    guesser = Client(REMOTE_ADDR="10.0.0.7")
    for _ in range(3):
        r = guesser.post("/accounts/login/", {"username": "alice", "password": "wrong-guess"})
        assert r.status_code == 200  # the form again, with its error
    r = guesser.post("/accounts/login/", {"username": "alice", "password": "wrong-again"})
    assert r.status_code == 429 and int(r["Retry-After"]) > 0
    # The user at their own address is never refused, and a good login never counts.
    other = Client(REMOTE_ADDR="10.0.0.8")
    for _ in range(5):
        r = other.post("/accounts/login/", {"username": "alice", "password": "alice-pass-123"})
        assert r.status_code == 302


def test_token_endpoint_blocks_a_username_at_an_address_after_failed_attempts(alice):  # noqa: F811
    guesser = APIClient(REMOTE_ADDR="10.0.0.9")
    for _ in range(3):
        r = guesser.post("/api/auth/token/", {"username": "alice", "password": "nope"}, format="json")
        assert r.status_code == 400 and r.json()["errors"][0]["field"] == "password"
    r = guesser.post("/api/auth/token/", {"username": "alice", "password": "nope"}, format="json")
    assert r.status_code == 429 and "too many failed logins" in r.json()["message"]
    good = APIClient(REMOTE_ADDR="10.0.0.10").post(
        "/api/auth/token/", {"username": "alice", "password": "alice-pass-123"}, format="json")
    assert good.status_code == 200 and good.json()["token"]


@pytest.mark.parametrize("password,fragment", [
    ("short", "too short"), ("password123", "too common"), ("8264019375", "entirely numeric"),
    ("carol-the-great", "too similar")])
def test_weak_passwords_are_refused(password, fragment):
    from webapp.accounts.services import user_create
    from webapp.core.errors import ApplicationError

    with pytest.raises(ApplicationError) as err:
        user_create(username="carol-the-great", password=password)
    assert err.value.errors[0]["field"] == "password" and fragment in err.value.message


def test_json_body_over_the_cap_is_a_413_before_it_is_read(api, project, settings):  # noqa: F811
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    body = json.dumps({"project": project.id, "name": "x" * 20_000, "dataset_version": 1,
                       "reward_version": 1})
    r = api.post("/api/runs/", body, content_type="application/json")
    assert r.status_code == 413 and "limit" in r.json()["message"]


def test_multipart_upload_over_the_cap_is_a_413_naming_the_file(api, project, settings):  # noqa: F811
    settings.DATASET_MAX_UPLOAD_BYTES = 100_000
    from django.core.files.uploadedfile import SimpleUploadedFile

    big = SimpleUploadedFile("big.jsonl", b'{"question": "q", "answer": "1"}\n' * 10_000)
    r = api.post("/api/datasets/", {"project": project.id, "name": "big", "task": "qa",
                                    "file": big}, format="multipart")
    assert r.status_code == 413
    assert r.json()["errors"][0]["field"] == "file"
    from webapp.datasets.models import Dataset

    assert not Dataset.objects.exists()


def _settings_process(module: str, env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("DJANGO_SETTINGS_MODULE", "DJANGO_SECRET_KEY")}
    if module:
        clean["DJANGO_SETTINGS_MODULE"] = module
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def test_wsgi_and_celery_default_to_production_which_needs_a_secret_key(tmp_path):
    for entry in ("import webapp.config.wsgi", "import workers.celery_app; "
                                               "from django.conf import settings; settings.DEBUG"):
        r = _settings_process("", {"OOLONG_DATA_DIR": str(tmp_path)}, entry)
        assert r.returncode != 0 and "DJANGO_SECRET_KEY is not set" in r.stderr, r.stderr[-800:]
    r = _settings_process("", {"OOLONG_DATA_DIR": str(tmp_path), "DJANGO_SECRET_KEY": "k" * 50,
                               "DJANGO_CACHE_URL": "redis://127.0.0.1:6379/5"},
                          "import webapp.config.wsgi; from django.conf import settings; "
                          "print(settings.SETTINGS_MODULE, settings.DEBUG)")
    assert r.returncode == 0, r.stderr[-800:]
    assert r.stdout.split() == ["webapp.config.settings.production", "False"]


def test_local_settings_make_a_private_key_per_machine(tmp_path):
    code = "import django; django.setup(); from django.conf import settings; print(settings.SECRET_KEY)"
    first = _settings_process("webapp.config.settings.local", {"OOLONG_DATA_DIR": str(tmp_path)}, code)
    again = _settings_process("webapp.config.settings.local", {"OOLONG_DATA_DIR": str(tmp_path)}, code)
    other = _settings_process("webapp.config.settings.local",
                              {"OOLONG_DATA_DIR": str(tmp_path / "other")}, code)
    key = first.stdout.strip()
    assert len(key) >= 50 and again.stdout.strip() == key and other.stdout.strip() != key
    assert stat.S_IMODE((tmp_path / "secret_key").stat().st_mode) == 0o600
    assert "insecure" not in key
