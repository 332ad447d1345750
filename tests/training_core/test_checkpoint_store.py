"""The durable store: checkpoints and a placed run's warm-started model outlive the nodes."""

from __future__ import annotations

import pytest

from training_core.checkpoint import COMPLETE
from training_core.checkpoint_store import CheckpointStore

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def _model_folder(path):
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text('{"a": 1}')
    (path / "model.safetensors").write_bytes(b"\x00\x01" * 1000)
    (path / "sub" / "tokenizer.json").write_text("{}")
    return path


def test_the_initial_model_is_complete_only_after_its_upload(tmp_path):
    store = CheckpointStore(f"file://{tmp_path / 'store'}", "run-7")
    assert not store.has_initial_model()
    made = _model_folder(tmp_path / "node-0" / "initial_model")
    store.upload_initial_model(made)
    assert store.has_initial_model()
    # Another node, another directory: the same files, without the store's marker.
    got = store.download_initial_model(tmp_path / "node-1" / "initial_model")
    files = sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file())
    assert files == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    assert (got / "model.safetensors").read_bytes() == (made / "model.safetensors").read_bytes()
    assert not (got / COMPLETE).exists()
    assert not any(p.name.endswith(".download") for p in got.parent.iterdir())
    # Checkpoints of the same run live beside it and do not see it.
    assert store.complete() == []


def test_a_half_uploaded_model_is_not_there(tmp_path):
    store = CheckpointStore(str(tmp_path / "store"), "run-8")
    store._put_tree(_model_folder(tmp_path / "m"), store._initial)  # the node died before the marker
    assert not store.has_initial_model()


def test_an_s3_store_url_opens_with_the_installed_dependencies():
    """Production stores are s3:// URLs: fsspec alone refuses the scheme ("Install s3fs"), so the
    nodes' install ([core]) must bring s3fs. Nothing is contacted: only the file system is made."""
    store = CheckpointStore("s3://oolong-bucket/prefix", "run-9")
    assert type(store.fs).__name__ == "S3FileSystem"
    assert store.root == "oolong-bucket/prefix/run-9/checkpoints"
