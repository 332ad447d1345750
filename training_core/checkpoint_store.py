"""The durable checkpoint store: where checkpoints outlive the nodes that wrote them.

A deployment names it with ``$OOLONG_CHECKPOINT_STORE``: a local folder (the default on one
machine is no store: the run directory is durable), or any fsspec URL (``s3://bucket/prefix``,
``gs://...``, ``file:///mnt/share``). It is infrastructure, so it is set by whoever runs the
nodes, never by a run spec. Layout: ``<store>/<run key>/checkpoints/step<N>/...`` with the same
``COMPLETE`` marker as on disk, written last.

After a checkpoint is saved every trainer rank uploads its directory (on several nodes each holds
its own shard files), then rank 0 writes the marker and prunes. A resumed run whose run
directory has no newer complete checkpoint (fresh nodes) downloads the store's latest first.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from training_core.checkpoint import COMPLETE, complete_tags

STORE_ENV = "OOLONG_CHECKPOINT_STORE"


class CheckpointStore:
    def __init__(self, url: str, run_key: str):
        import fsspec

        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = f"{root.rstrip('/')}/{run_key}/checkpoints"

    @classmethod
    def from_env(cls, run_dir: Path) -> CheckpointStore | None:
        url = os.environ.get(STORE_ENV, "").strip()
        return cls(url, Path(run_dir).resolve().name) if url else None

    def _tag(self, tag: str) -> str:
        return f"{self.root}/{tag}"

    def upload(self, local: Path, tag: str) -> None:
        """This rank's files of one checkpoint (the marker is rank 0's, after everyone's)."""
        for path in sorted(p for p in local.rglob("*") if p.is_file() and p.name != COMPLETE):
            remote = f"{self._tag(tag)}/{path.relative_to(local).as_posix()}"
            self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), remote)

    def mark_complete(self, tag: str) -> None:
        self.fs.pipe_file(f"{self._tag(tag)}/{COMPLETE}", b"ok")

    def complete(self) -> list[tuple[int, str]]:
        if not self.fs.exists(self.root):
            return []
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.root, detail=False))
        return complete_tags(names, lambda tag: self.fs.exists(f"{self._tag(tag)}/{COMPLETE}"))

    def latest(self) -> tuple[int, str] | None:
        found = self.complete()
        return found[-1] if found else None

    def download(self, tag: str, ckpt_root: Path) -> Path:
        """The whole checkpoint into ``ckpt_root/tag`` (through a temporary folder: a broken
        download never looks complete)."""
        dest = ckpt_root / tag
        tmp = ckpt_root / f".{tag}.download"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        prefix = self._tag(tag).rstrip("/") + "/"
        for remote in self.fs.find(self._tag(tag)):
            local = tmp / remote[len(prefix):] if remote.startswith(prefix) else tmp / Path(remote).name
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(local))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return dest

    def prune(self, keep: int) -> None:
        for _, tag in self.complete()[:-keep]:
            self.fs.rm(self._tag(tag), recursive=True)
