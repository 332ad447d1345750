"""`oolong runs ...` against the live web app (real HTTP, real database)."""

import pytest
import yaml

from training_core.cli import main
from webapp.runs.models import Run
from webapp.runs.services import run_status_set
from webapp.tracking.services import metrics_ingest

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cli_env(monkeypatch, live_server, alice):
    from webapp.accounts.services import token_get_or_create

    monkeypatch.setenv("OOLONG_URL", live_server.url)
    monkeypatch.setenv("OOLONG_TOKEN", token_get_or_create(user=alice))


def test_create_list_cancel_compare_watch(cli_env, capsys, tmp_path, project, dataset_version, reward_version):
    spec = tmp_path / "run.yaml"
    spec.write_text(yaml.safe_dump({"trainer": {"steps": 3}}))
    base = ["runs", "create", "--project", str(project.id), "--dataset-version", str(dataset_version.id),
            "--reward-version", str(reward_version.id)]
    assert main([*base, "--name", "cli-a", "--config", str(spec), "trainer.lr=0.01"]) == 0
    assert main([*base, "--name", "cli-b", "--config", str(spec)]) == 0
    a, b = Run.objects.get(name="cli-a"), Run.objects.get(name="cli-b")
    assert a.spec["trainer"]["lr"] == 0.01 and a.spec["trainer"]["steps"] == 3

    assert main(["runs", "list"]) == 0
    out = capsys.readouterr().out
    assert "cli-a" in out and "cli-b" in out

    metrics_ingest(run=a, points=[{"key": "reward/mean", "step": 3, "value": 0.75},
                                  {"key": "version", "step": 3, "value": 3}])
    assert main(["runs", "compare", str(a.id), str(b.id)]) == 0
    out = capsys.readouterr().out
    assert "0.7500" in out and "trainer.lr" in out

    run_status_set(run=a, status="running")
    run_status_set(run=a, status="succeeded")
    assert main(["runs", "watch", str(a.id), "--interval", "0.1"]) == 0
    assert "succeeded" in capsys.readouterr().out

    assert main(["runs", "cancel", str(b.id)]) == 0
    b.refresh_from_db()
    assert b.status == "cancelled"
    assert main(["runs", "resume", str(b.id)]) == 0
    b.refresh_from_db()
    assert (b.status, b.attempt) == ("queued", 2)
    assert main(["runs", "resume", str(b.id)]) != 0  # queued: nothing to resume
    assert "this one is queued" in capsys.readouterr().err


def test_errors_are_printed_with_fields(cli_env, capsys, project, dataset_version, reward_version):
    code = main(["runs", "create", "--project", str(project.id), "--dataset-version",
                 str(dataset_version.id), "--reward-version", str(reward_version.id),
                 "rollout.max_staleness=-2"])
    assert code == 2
    assert "spec.rollout.max_staleness" in capsys.readouterr().err
    assert not Run.objects.exists()


def test_sweeps_create_list_show_compare(cli_env, capsys, tmp_path, project, dataset_version,
                                         reward_version):
    from webapp.sweeps.models import Sweep

    base = ["sweeps", "create", "--project", str(project.id), "--dataset-version",
            str(dataset_version.id), "--reward-version", str(reward_version.id), "--name", "lrs",
            "--vary", "trainer.lr=1e-3,3e-4", "--vary", "algorithm.preset=grpo,dapo",
            "trainer.steps=4"]
    assert main(base) == 0
    assert "created sweep" in capsys.readouterr().out
    sweep = Sweep.objects.get(name="lrs")
    runs = list(sweep.runs.order_by("id"))
    assert [(r.spec["trainer"]["lr"], r.spec["algorithm"]["preset"]) for r in runs] == [
        (1e-3, "grpo"), (1e-3, "dapo"), (3e-4, "grpo"), (3e-4, "dapo")]
    assert all(r.spec["trainer"]["steps"] == 4 for r in runs)
    assert sweep.axes[0] == {"field": "trainer.lr", "values": [1e-3, 3e-4]}  # numbers, not text

    assert main(["sweeps", "list"]) == 0
    assert "trainer.lr=0.001,0.0003" in capsys.readouterr().out
    assert main(["sweeps", "show", str(sweep.id)]) == 0
    shown = capsys.readouterr().out
    assert shown.count("queued") == 4 and all(str(r.id) in shown for r in runs)
    for i, run in enumerate(runs):
        metrics_ingest(run=run, points=[{"key": k, "step": s, "value": v, "time": 1e9 + s}
                                        for s in range(1, 5)
                                        for k, v in (("version", s), ("reward/mean", 0.1 * i + s / 10))])
    assert main(["sweeps", "compare", str(sweep.id), "--target", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "to 0.500" in out and "algorithm.preset" in out and "trainer.lr" in out
    assert out.count("lrs ") >= 4

    # From a run: fresh runs of its configuration; a bad --vary is explained.
    assert main(["sweeps", "create", "--from-run", str(runs[0].id), "--vary",
                 "rollout.max_staleness=2,0"]) == 0
    assert Sweep.objects.count() == 2
    assert main(["sweeps", "create", "--from-run", str(runs[0].id), "--vary", "eta"]) == 2
    assert "field=value,value" in capsys.readouterr().err
    assert main(["sweeps", "create", "--vary", "trainer.lr=1,2"]) == 2
    assert "--project" in capsys.readouterr().err
