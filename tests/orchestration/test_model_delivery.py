"""The run's model goes to its store once, and a node takes it only as published."""

from __future__ import annotations

import hashlib
import json

import pytest
from orchestration.model_delivery import (
    MANIFEST,
    ModelDeliveryError,
    fetch_model,
    publish_model,
)


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    (folder / "sub" / "tokenizer.json").write_text("{}")
    return folder


def test_a_model_published_once_is_fetched_and_checked(tmp_path, model):
    store = (tmp_path / "store").as_uri()
    digest = publish_model(store, "run-3", model)
    remote = tmp_path / "store" / "run-3" / "model"
    assert hashlib.sha256((remote / MANIFEST).read_bytes()).hexdigest() == digest
    assert (remote / "COMPLETE").exists()
    stamp = (remote / "model.safetensors").stat().st_mtime_ns
    assert publish_model(store, "run-3", model) == digest  # uploaded once
    assert (remote / "model.safetensors").stat().st_mtime_ns == stamp
    got = fetch_model(store, "run-3", tmp_path / "node" / "model", digest)
    assert (got / "sub" / "tokenizer.json").read_text() == "{}"
    assert (got / "model.safetensors").read_bytes() == b"\0" * 1000
    assert fetch_model(store, "run-3", got, digest) == got  # already here: kept


def test_a_node_refuses_another_model_or_a_changed_file(tmp_path, model):
    store = (tmp_path / "store").as_uri()
    digest = publish_model(store, "run-4", model)
    with pytest.raises(ModelDeliveryError, match="not the run's"):
        fetch_model(store, "run-4", tmp_path / "a", "0" * 64)
    (tmp_path / "store" / "run-4" / "model" / "model.safetensors").write_bytes(b"\1" * 1000)
    with pytest.raises(ModelDeliveryError, match="does not match its sha256"):
        fetch_model(store, "run-4", tmp_path / "b", digest)
    assert not (tmp_path / "b").exists()
    with pytest.raises(ModelDeliveryError, match="no COMPLETE marker"):
        fetch_model(store, "run-5", tmp_path / "c", digest)


def test_a_manifest_cannot_write_outside_the_model(tmp_path, model):
    store = tmp_path / "store"
    publish_model(store.as_uri(), "run-6", model)
    manifest = {"files": {"../escape": hashlib.sha256(b"x").hexdigest()}}
    data = json.dumps(manifest).encode()
    (store / "run-6" / "model" / MANIFEST).write_bytes(data)
    with pytest.raises(ModelDeliveryError, match="outside it"):
        fetch_model(store.as_uri(), "run-6", tmp_path / "node" / "model",
                    hashlib.sha256(data).hexdigest())
    assert not (tmp_path / "node" / "escape").exists()
