from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient


@pytest.fixture(autouse=True)
def _media(settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path / "media"


@pytest.fixture
def alice(db):
    from webapp.accounts.services import user_create

    return user_create(username="alice", password="alice-pass-123")


@pytest.fixture
def bob(db):
    from webapp.accounts.services import user_create

    return user_create(username="bob", password="bob-pass-123")


@pytest.fixture
def project(alice):
    from webapp.accounts.services import project_create

    return project_create(user=alice, name="Alice lab")


@pytest.fixture
def bob_project(bob):
    from webapp.accounts.services import project_create

    return project_create(user=bob, name="Bob lab")


def client_for(user) -> APIClient:
    from webapp.accounts.services import token_get_or_create

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {token_get_or_create(user=user)}")
    return c


@pytest.fixture
def api(alice):
    return client_for(alice)


@pytest.fixture
def bob_api(bob):
    return client_for(bob)


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


QA_ROWS = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]


@pytest.fixture
def dataset_version(project, alice):
    from webapp.datasets.services import dataset_upload

    return dataset_upload(project=project, user=alice, name="adds", task="arithmetic",
                          filename="adds.jsonl", data=jsonl(QA_ROWS))


@pytest.fixture
def reward_version(project, alice):
    from webapp.rewards.services import reward_function_create

    return reward_function_create(project=project, user=alice, name="exact", builtin="exact")


@pytest.fixture
def run(project, alice, dataset_version, reward_version):
    from webapp.runs.services import run_create

    return run_create(project=project, user=alice, name="r1", dataset_version=dataset_version,
                      reward_version=reward_version, spec={"trainer": {"steps": 5}})


@pytest.fixture
def ingest_token(run) -> str:
    """A fresh ingest token for ``run`` (only its hash is stored)."""
    from webapp.runs.services import run_token_issue

    return run_token_issue(run=run, purpose="test")
