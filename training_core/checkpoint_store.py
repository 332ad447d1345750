"""The durable checkpoint store: where checkpoints outlive the nodes that wrote them.

A deployment names it with ``$OOLONG_CHECKPOINT_STORE``: a local folder (the default on one
machine is no store: the run directory is durable), or any fsspec URL (``s3://bucket/prefix``,
``gs://...``, ``file:///mnt/share``). It is infrastructure, so it is set by whoever runs the
nodes, never by a run spec. Layout: ``<store>/<run key>/checkpoints/step<N>/...`` with the same
``COMPLETE`` marker as on disk, written last.

A placed run's warm-started model goes there too (``<store>/<run key>/initial_model/``, with its
own marker): one node makes it, every other node fetches it before it starts.

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
        self.run_root = f"{root.rstrip('/')}/{run_key}"
        self.root = f"{self.run_root}/checkpoints"

    @classmethod
    def from_env(cls, run_dir: Path) -> CheckpointStore | None:
        url = os.environ.get(STORE_ENV, "").strip()
        return cls(url, Path(run_dir).resolve().name) if url else None

    def _tag(self, tag: str) -> str:
        return f"{self.root}/{tag}"

    def _put_tree(self, local: Path, remote_root: str) -> None:
        for path in sorted(p for p in local.rglob("*") if p.is_file() and p.name != COMPLETE):
            remote = f"{remote_root}/{path.relative_to(local).as_posix()}"
            self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), remote)

    def _get_tree(self, remote_root: str, dest: Path) -> Path:
        """Every file under ``remote_root`` into ``dest``, through a temporary folder beside it:
        a broken download never looks complete."""
        tmp = dest.with_name(f".{dest.name}.download")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        prefix = remote_root.rstrip("/") + "/"
        for remote in self.fs.find(remote_root):
            local = tmp / remote[len(prefix):] if remote.startswith(prefix) else tmp / Path(remote).name
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(local))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return dest

    def upload(self, local: Path, tag: str) -> None:
        """This rank's files of one checkpoint (the marker is rank 0's, after everyone's)."""
        self._put_tree(local, self._tag(tag))

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
        """The whole checkpoint into ``ckpt_root/tag``."""
        return self._get_tree(self._tag(tag), ckpt_root / tag)

    # ---- the warm-started model a placed run starts from -----------------------------------

    @property
    def _initial(self) -> str:
        return f"{self.run_root}/initial_model"

    def has_initial_model(self) -> bool:
        return self.fs.exists(f"{self._initial}/{COMPLETE}")

    def upload_initial_model(self, local: Path) -> None:
        self._put_tree(local, self._initial)
        self.fs.pipe_file(f"{self._initial}/{COMPLETE}", b"ok")

    def download_initial_model(self, dest: Path) -> Path:
        """Into ``dest`` (without the marker: a model folder, as the warm start wrote it)."""
        out = self._get_tree(self._initial, dest)
        (out / COMPLETE).unlink(missing_ok=True)
        return out

    def prune(self, keep: int) -> None:
        for _, tag in self.complete()[:-keep]:
            self.fs.rm(self._tag(tag), recursive=True)
