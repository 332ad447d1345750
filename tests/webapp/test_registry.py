"""The model registry: a run's version exported by the worker's service into the store (the real
engine export of a tiny model), its lineage and evaluation from the tracker, aliases, the
streamed download, the run page's button, and the runs' permissions across projects."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.webapp.conftest import client_for
from training_core.config import dump_spec, load_spec
from webapp.registry.archive import CHUNK
from webapp.registry.models import ModelVersion
from webapp.registry.services import model_version_export
from webapp.runs.services import run_status_set
from webapp.tracking.services import metrics_ingest

pytestmark = pytest.mark.django_db


def _weights(shift: float) -> dict[str, torch.Tensor]:
    from training_core.models.loading import load_model
    from training_core.models.paths import resolve_model_dir

    model = load_model(resolve_model_dir("tiny"))
    return {k: (v + shift).contiguous() for k, v in model.state_dict().items()
            if k != "lm_head.weight"}


@pytest.fixture
def finished(run, tmp_path, monkeypatch):
    """``run`` finished, with the files its flow leaves (spec, metrics, the served weights of
    versions 2 and 3) and the tracker's evaluations: v2 is the best (0.7 against 0.5)."""
    monkeypatch.setenv("OOLONG_RUNS_DIR", str(tmp_path / "runs"))
    from orchestration.trigger import flow_run_dir

    run_dir = flow_run_dir(run.id)
    run_dir.mkdir(parents=True)
    dump_spec(load_spec(None, ["model.path=tiny", "rollout.max_new_tokens=8"]), run_dir / "spec.yaml")
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "version": s}) + "\n" for s in (1, 2, 3)))
    for v in (2, 3):
        (run_dir / "weights" / f"v{v}").mkdir(parents=True)
        save_file(_weights(0.01 * v), str(run_dir / "weights" / f"v{v}" / "model.safetensors"))
    metrics_ingest(run=run, points=[
        {"key": "eval/accuracy", "step": 2, "value": 0.7}, {"key": "version", "step": 2, "value": 2},
        {"key": "eval/accuracy", "step": 3, "value": 0.5}, {"key": "version", "step": 3, "value": 3},
        # an evaluation that recorded its own version: counted there, not at the step's
        {"key": "eval/heldout/greedy_accuracy", "step": 4, "value": 0.9},
        {"key": "eval/heldout/version", "step": 4, "value": 3}, {"key": "version", "step": 4, "value": 4}])
    run_status_set(run=run, status="running")
    run_status_set(run=run, status="succeeded")
    return run


def _export(api, run, version, **extra) -> dict:
    resp = api.post(f"/api/runs/{run.id}/export/", {"version": version, **extra}, format="json")
    assert resp.status_code == 202, resp.content
    assert resp.json()["status"] == "pending"
    model_version_export(model_version_id=resp.json()["id"])  # what the worker's task runs
    return api.get(f"/api/models/{resp.json()['id']}/").json()


def test_best_is_exported_and_registered_with_its_lineage(api, finished, dataset_version,
                                                          reward_version):
    m = _export(api, finished, "best")
    assert (m["status"], m["version"], m["step"], m["source"]) == ("ready", 2, 2, "pushed")
    assert m["evaluation"] == {"eval/accuracy": 0.7}
    assert m["dataset_version_id"] == dataset_version.id and m["reward_version_id"] == reward_version.id
    assert m["lineage"]["run"]["id"] == finished.id
    assert m["lineage"]["dataset"] == {"source": "synthetic:arithmetic", "version_id": dataset_version.id,
                                       "name": "adds", "version": dataset_version.version}
    assert m["lineage"]["reward"]["name"] == "exact" and m["lineage"]["spec"]["model"]["path"] == "tiny"
    assert m["name"] == finished.name and m["size_bytes"] > 0
    # the registered folder holds version 2's weights, and the card says where they came from
    mv = ModelVersion.objects.get(id=m["id"])
    exported = load_file(f"{mv.path}/model.safetensors")
    assert torch.equal(exported["model.norm.weight"], _weights(0.02)["model.norm.weight"])
    card = open(f"{mv.path}/README.md").read()
    assert "`eval/accuracy` | 0.7" in card and "adds" in card
    # the worker's task run twice changes nothing
    assert model_version_export(model_version_id=m["id"])["status"] == "ready"
    assert finished.events.filter(kind="model_exported").count() == 1

    again = api.post(f"/api/runs/{finished.id}/export/", {"version": "2"}, format="json")
    assert again.status_code == 409 and f"registered as model version {m['id']}" in again.json()["message"]
    again = _export(api, finished, "best")  # resolved by the worker to the same version
    assert again["status"] == "failed" and f"registered as model version {m['id']}" in again["error"]
    latest = _export(api, finished, "latest", name="arith")
    assert (latest["status"], latest["version"], latest["name"]) == ("ready", 3, "arith")
    assert latest["evaluation"] == {"eval/accuracy": 0.5, "eval/heldout/greedy_accuracy": 0.9,
                                    "eval/heldout/version": 3}

    listed = api.get("/api/models/", {"run": finished.id, "status": "ready"}).json()
    assert {r["id"] for r in listed["results"]} == {m["id"], latest["id"]}


def test_an_export_that_cannot_be_made_says_why(api, finished):
    gone = _export(api, finished, "7")
    assert gone["status"] == "failed" and gone["error"].startswith("version: --version 7")
    bad = api.post(f"/api/runs/{finished.id}/export/", {"version": "newest"}, format="json")
    assert bad.status_code == 400 and bad.json()["errors"][0]["field"] == "version"
    bad = api.post(f"/api/runs/{finished.id}/export/", {"version": "1", "name": "a b"}, format="json")
    assert bad.status_code == 400 and bad.json()["errors"][0]["field"] == "name"


def test_a_run_that_never_started_has_nothing_to_export(api, run):
    resp = api.post(f"/api/runs/{run.id}/export/", {"version": "latest"}, format="json")
    assert resp.status_code == 409 and "has not started" in resp.json()["message"]


def test_aliases_move_between_versions(api, finished):
    a, b = _export(api, finished, "2"), _export(api, finished, "3")
    assert api.post(f"/api/models/{a['id']}/aliases/", {"alias": "production"},
                    format="json").json()["aliases"] == ["production"]
    moved = api.post(f"/api/models/{b['id']}/aliases/", {"alias": "production"}, format="json")
    assert moved.status_code == 200 and moved.json()["aliases"] == ["production"]
    assert api.get(f"/api/models/{a['id']}/").json()["aliases"] == []
    found = api.get("/api/models/", {"project": finished.project_id, "alias": "production"}).json()
    assert [r["id"] for r in found["results"]] == [b["id"]]
    bad = api.post(f"/api/models/{b['id']}/aliases/", {"alias": "Prod uction"}, format="json")
    assert bad.status_code == 400 and bad.json()["errors"][0]["field"] == "alias"
    assert api.delete(f"/api/models/{b['id']}/aliases/production/").status_code == 204
    assert api.delete(f"/api/models/{b['id']}/aliases/production/").status_code == 404
    assert api.get(f"/api/models/{b['id']}/").json()["aliases"] == []


def test_the_download_is_the_folder_streamed_as_tar(api, finished):
    m = _export(api, finished, "3")
    resp = api.get(f"/api/models/{m['id']}/download/")
    assert resp.status_code == 200 and resp.streaming
    assert resp["Content-Type"] == "application/x-tar"
    assert f'{finished.name}-v3.tar' in resp["Content-Disposition"]
    chunks = list(resp.streaming_content)
    folder = ModelVersion.objects.get(id=m["id"]).path
    weights = open(f"{folder}/model.safetensors", "rb").read()
    # never the whole model in one piece: the weights file went out in bounded chunks
    assert len(weights) > CHUNK and max(len(c) for c in chunks) <= CHUNK
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        names = tar.getnames()
        assert f"{finished.name}-v3/model.safetensors" in names
        assert f"{finished.name}-v3/tokenizer.json" in names
        assert tar.extractfile(f"{finished.name}-v3/model.safetensors").read() == weights
    pending = api.post(f"/api/runs/{finished.id}/export/", {"version": "2"}, format="json").json()
    assert api.get(f"/api/models/{pending['id']}/download/").status_code == 409
    # one export of a run at a time
    busy = api.post(f"/api/runs/{finished.id}/export/", {"version": "latest"}, format="json")
    assert busy.status_code == 409 and "still being exported" in busy.json()["message"]


def test_another_projects_user_sees_nothing(api, bob, bob_project, finished):
    m = _export(api, finished, "3")
    api.post(f"/api/models/{m['id']}/aliases/", {"alias": "production"}, format="json")
    bob_api = client_for(bob)
    assert bob_api.get("/api/models/").json()["results"] == []
    assert bob_api.get("/api/models/", {"project": finished.project_id}).json()["results"] == []
    for path in (f"/api/models/{m['id']}/", f"/api/models/{m['id']}/download/"):
        assert bob_api.get(path).status_code == 404, path
    assert bob_api.post(f"/api/runs/{finished.id}/export/", {"version": "3"},
                        format="json").status_code == 404
    assert bob_api.post(f"/api/models/{m['id']}/aliases/", {"alias": "mine"},
                        format="json").status_code == 404
    assert bob_api.delete(f"/api/models/{m['id']}/aliases/production/").status_code == 404
    assert ModelVersion.objects.get(id=m["id"]).aliases.get().name == "production"
    assert ModelVersion.objects.filter(run=finished).count() == 1
    # the run page's export button: Bob cannot press it for Alice's run either
    bob_api.force_login(bob)
    assert bob_api.post(f"/runs/{finished.id}/export/", {"version": "3"}).status_code == 404


def test_the_run_page_exports_and_lists_its_models(api, alice, finished):
    from django.test import Client

    browser = Client()
    browser.force_login(alice)
    page = browser.get(f"/runs/{finished.id}/").content.decode()
    assert 'id="export-run"' in page and "No export yet." in page
    resp = browser.post(f"/runs/{finished.id}/export/", {"version": "best"})
    assert resp.status_code == 302
    mv = ModelVersion.objects.get(run=finished)
    assert (mv.requested, mv.status) == ("best", "pending")
    from workers.tasks import model_export

    assert model_export.apply(args=[mv.id]).get()["version"] == 2  # the worker's task, in process
    page = browser.get(f"/runs/{finished.id}/").content.decode()
    assert f'href="/api/models/{mv.id}/download/"' in page and "0.700" in page


def test_a_lost_export_does_not_hold_the_run_for_ever(api, finished):
    from datetime import timedelta

    from django.utils import timezone

    from webapp.registry.services import EXPORT_STALE_S

    lost = api.post(f"/api/runs/{finished.id}/export/", {"version": "3"}, format="json").json()
    assert api.post(f"/api/runs/{finished.id}/export/", {"version": "2"},
                    format="json").status_code == 409
    ModelVersion.objects.filter(id=lost["id"]).update(
        created_at=timezone.now() - timedelta(seconds=EXPORT_STALE_S + 1))
    assert api.post(f"/api/runs/{finished.id}/export/", {"version": "2"},
                    format="json").status_code == 202


@pytest.fixture
def remote(run, tmp_path, monkeypatch):
    """``run`` finished on another node: no run directory on this worker, its checkpoint of step
    2 (version 2: a real DeepSpeed checkpoint of perturbed tiny weights) in the durable store
    (the local-filesystem form of ``$OOLONG_CHECKPOINT_STORE``), its versions in the tracker.
    Returns the weights the checkpoint holds."""
    from training_core.checkpoint_store import STORE_ENV, CheckpointStore
    from training_core.models.paths import resolve_model_dir
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    monkeypatch.setenv("OOLONG_RUNS_DIR", str(tmp_path / "runs"))  # nothing there
    url = f"file://{tmp_path / 'store'}"
    monkeypatch.setenv(STORE_ENV, url)
    trainer = DeepSpeedTrainer(resolve_model_dir("tiny"), lr=1e-3, weight_decay=0.0,
                               grad_clip=1.0, zero_stage=0)
    with torch.no_grad():
        for p in trainer.engine.module.parameters():
            p.add_(0.02)
    sent = {k: v.clone() for k, v in trainer.weights().items()}
    trainer.save_checkpoint(tmp_path / "node" / "checkpoints", "step2", {"version": 2})
    store = CheckpointStore(url, f"run-{run.id}")
    store.upload(tmp_path / "node" / "checkpoints" / "step2", "step2")
    store.mark_complete("step2")
    metrics_ingest(run=run, points=[{"key": "version", "step": s, "value": s} for s in (1, 2, 3)])
    run_status_set(run=run, status="running")
    run_status_set(run=run, status="succeeded")
    return sent


def test_a_run_that_trained_on_another_node_is_exported_from_its_checkpoint_store(
        api, run, remote, monkeypatch, tmp_path):
    m = _export(api, run, "latest")
    assert (m["status"], m["version"], m["step"], m["source"]) == ("ready", 2, 2, "checkpoint"), m
    assert m["lineage"]["run"]["dir"].startswith("file://") and m["lineage"]["run"]["id"] == run.id
    got = load_file(str(ModelVersion.objects.get(id=m["id"]).path + "/model.safetensors"))
    for name, tensor in remote.items():
        assert torch.equal(got[name], tensor), name
    # nothing of the staging is left in the model store
    from webapp.registry.services import model_store
    assert not any((model_store() / ".staging").glob("*"))
    # a version the store does not hold is refused naming what it holds
    gone = _export(api, run, "3")
    assert gone["status"] == "failed" and "held: [2]" in gone["error"], gone["error"]


def test_a_remote_run_without_a_store_or_checkpoints_says_what_is_missing(api, run, remote,
                                                                          monkeypatch, tmp_path):
    from training_core.checkpoint_store import STORE_ENV

    monkeypatch.setenv(STORE_ENV, f"file://{tmp_path / 'empty-store'}")
    empty = _export(api, run, "latest")
    assert empty["status"] == "failed" and empty["error"].startswith("run: ")
    assert "holds no complete checkpoint" in empty["error"] and "checkpoint.every" in empty["error"]
    monkeypatch.delenv(STORE_ENV)
    none = _export(api, run, "latest")
    assert none["status"] == "failed" and STORE_ENV in none["error"], none["error"]
    assert "not on this worker" in none["error"]
