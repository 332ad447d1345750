"""`oolong models ...` against the live web app (real HTTP, real database, the worker's export
service run in the test's place)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.webapp.test_registry import finished  # noqa: F401 - the fixture
from training_core.cli import main
from webapp.registry.models import ModelVersion
from webapp.registry.services import model_version_export

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cli_env(monkeypatch, live_server, alice):
    from webapp.accounts.services import token_get_or_create

    monkeypatch.setenv("OOLONG_URL", live_server.url)
    monkeypatch.setenv("OOLONG_TOKEN", token_get_or_create(user=alice))


def test_export_list_alias_show_download(cli_env, capsys, tmp_path, finished):  # noqa: F811
    assert main(["models", "export", str(finished.id), "--version", "best"]) == 0
    mv = ModelVersion.objects.get(run=finished)
    assert "queued" in capsys.readouterr().out and mv.requested == "best"
    model_version_export(model_version_id=mv.id)
    mv.refresh_from_db()

    assert main(["models", "list", "--project", str(finished.project_id)]) == 0
    out = capsys.readouterr().out
    assert f"run {finished.id}" in out and "v2" in out and "70.0%" in out
    assert main(["models", "alias", str(mv.id), "production"]) == 0
    assert "production -> model version" in capsys.readouterr().out
    assert main(["models", "show", "production", "--project", str(finished.project_id)]) == 0
    out = capsys.readouterr().out
    assert '"version": 2' in out and '"production"' in out and '"dataset"' in out

    folder = tmp_path / "prod"
    assert main(["models", "download", "production", "--project", str(finished.project_id),
                 "--out", str(folder)]) == 0
    registered = load_file(f"{mv.path}/model.safetensors")
    downloaded = load_file(str(folder / "model.safetensors"))
    assert registered.keys() == downloaded.keys()
    assert all((registered[k] == downloaded[k]).all() for k in registered)
    assert (folder / "README.md").exists() and not list(tmp_path.glob(".prod*"))
    assert main(["models", "download", str(mv.id), "--out", str(tmp_path / "m.tar")]) == 0
    assert (tmp_path / "m.tar").stat().st_size > (folder / "model.safetensors").stat().st_size

    # errors are named: a taken folder, an unknown alias, someone else's model
    assert main(["models", "download", str(mv.id), "--out", str(folder)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["models", "show", "staging", "--project", str(finished.project_id)]) == 2
    assert "no alias 'staging'" in capsys.readouterr().err
    assert main(["models", "show", str(mv.id + 1000)]) == 2
    assert "404" in capsys.readouterr().err
