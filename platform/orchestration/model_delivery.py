"""The model a placed run starts from, delivered through the run's store: uploaded once by the
control plane, fetched and checked by every node before its processes start. A node never needs
a model hub, nor the control machine's disk.

The spec names the model (``tiny``, ``smollm2`` or a Hugging Face folder, resolved on the control
plane by ``spec_model_dir``); its files go to ``<store>/run-<id>/model/`` with ``MANIFEST.json``
(each file's sha256) and, written last, the ``COMPLETE`` marker. The manifest's own sha256 names
the model: the flow passes it to each node process (a parameter, not a secret), and a node
refuses a manifest of another hash or a file that does not match its line. A resumed run finds
the same model there and uploads nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from training_core.checkpoint import COMPLETE

MANIFEST = "MANIFEST.json"


class ModelDeliveryError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_of(folder: Path) -> bytes:
    """Every file under ``folder`` (relative path -> sha256), as canonical JSON."""
    files = {p.relative_to(folder).as_posix(): _sha256(p)
             for p in sorted(folder.rglob("*")) if p.is_file()}
    if "config.json" not in files:
        raise ModelDeliveryError(f"{folder} is not a Hugging Face model folder (no config.json)")
    return json.dumps({"files": files}, sort_keys=True, indent=1).encode()


def _remote(store_url: str, run_key: str):
    import fsspec

    fs, root = fsspec.core.url_to_fs(store_url.rstrip("/"))
    return fs, f"{root.rstrip('/')}/{run_key}/model"


def publish_model(store_url: str, run_key: str, folder: Path) -> str:
    """Upload ``folder`` as the run's model unless the store holds it already; returns the
    manifest's sha256 (what the nodes check)."""
    manifest = manifest_of(folder)
    digest = hashlib.sha256(manifest).hexdigest()
    fs, remote = _remote(store_url, run_key)
    if fs.exists(f"{remote}/{COMPLETE}") and fs.cat_file(f"{remote}/{MANIFEST}") == manifest:
        return digest
    if fs.exists(remote):  # a partial or different upload: replaced whole
        fs.rm(remote, recursive=True)
    for rel in json.loads(manifest)["files"]:
        target = f"{remote}/{rel}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(folder / rel), target)
    fs.pipe_file(f"{remote}/{MANIFEST}", manifest)
    fs.pipe_file(f"{remote}/{COMPLETE}", b"ok")
    return digest


def fetch_model(store_url: str, run_key: str, dest: Path, digest: str) -> Path:
    """The run's model into ``dest``, every file checked against the manifest whose sha256 is
    ``digest``; a folder already there with that manifest is kept (one download per node; a
    node's server and trainer flows may fetch at once, each into a folder of its own first)."""
    if _holds(dest, digest):
        return dest
    fs, remote = _remote(store_url, run_key)
    if not fs.exists(f"{remote}/{COMPLETE}"):
        raise ModelDeliveryError(f"the run's model is not in the store ({store_url}/{run_key}/"
                                 "model has no COMPLETE marker): the flow uploads it before "
                                 "placing any process")
    manifest = fs.cat_file(f"{remote}/{MANIFEST}")
    if hashlib.sha256(manifest).hexdigest() != digest:
        raise ModelDeliveryError(f"the model in the store is not the run's: its manifest's "
                                 f"sha256 is {hashlib.sha256(manifest).hexdigest()}, the flow "
                                 f"published {digest}")
    tmp = dest.with_name(f".{dest.name}.download-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    for rel, want in json.loads(manifest)["files"].items():
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ModelDeliveryError(f"the model's manifest names a path outside it: {rel!r}")
        local = tmp / rel
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{remote}/{rel}", str(local))
        if _sha256(local) != want:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ModelDeliveryError(f"the model's file {rel} does not match its sha256 in the "
                                     "manifest: refused")
    (tmp / MANIFEST).write_bytes(manifest)
    if dest.exists() and not _holds(dest, digest):
        shutil.rmtree(dest, ignore_errors=True)  # another model (an earlier run's leftovers)
    try:
        tmp.rename(dest)
    except OSError:  # another process of this node got there first
        shutil.rmtree(tmp, ignore_errors=True)
        if not _holds(dest, digest):
            raise
    return dest


def _holds(folder: Path, digest: str) -> bool:
    """``folder`` is a fetched model whose manifest has this sha256."""
    manifest = folder / MANIFEST
    return manifest.is_file() and hashlib.sha256(manifest.read_bytes()).hexdigest() == digest
