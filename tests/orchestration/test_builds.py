"""The build nodes install: this tree's wheel (built once per content) or a release's, and its
pins, published in the store by their hash."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest
from orchestration import builds

ROOT = Path(__file__).resolve().parents[2]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_wheel_of_this_tree_is_built_once_per_content(tmp_path):
    wheel = builds.build_wheel(ROOT, cache=tmp_path)
    assert builds.build_wheel(ROOT, cache=tmp_path) == wheel  # the same tree: no rebuild
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert "orchestration/flows/node_processes.py" in names and "training_core/train.py" in names
    assert not [n for n in names if n.startswith("tests/")]


def test_the_build_is_published_by_hash_once(tmp_path, monkeypatch):
    monkeypatch.delenv(builds.BUILD_DIR_ENV, raising=False)
    store = tmp_path / "store"
    build = builds.publish_build(store.as_uri())
    assert set(build) == {"wheel", "constraints", "sglang_constraints"}
    for name, f in build.items():
        path = Path(f["url"].removeprefix("file://"))
        assert f["url"].startswith("file://") and path.is_file(), name
        assert path.parent.name == f["sha256"] == _sha(path)  # <store>/builds/<sha256>/<name>
        assert path.parent.parent == store / "builds"
    assert Path(build["constraints"]["url"]).name == "constraints-gpu.txt"
    assert _sha(ROOT / "constraints-gpu.txt") == build["constraints"]["sha256"]
    stamp = Path(build["wheel"]["url"].removeprefix("file://")).stat().st_mtime_ns
    assert builds.publish_build(store.as_uri()) == build  # published once
    assert Path(build["wheel"]["url"].removeprefix("file://")).stat().st_mtime_ns == stamp
    cpu = builds.publish_build(store.as_uri(), gpu=False)
    assert Path(cpu["constraints"]["url"]).name == "constraints.txt"


def test_a_release_folder_is_used_as_it_is(tmp_path, monkeypatch):
    release = tmp_path / "release"
    release.mkdir()
    for name in ("constraints-gpu.txt", "constraints-sglang.txt"):
        shutil.copy(ROOT / name, release / name)
    (release / "oolong-9.9.9-py3-none-any.whl").write_bytes(b"a release")
    monkeypatch.setenv(builds.BUILD_DIR_ENV, str(release))
    build = builds.publish_build((tmp_path / "store").as_uri())
    assert build["wheel"]["sha256"] == hashlib.sha256(b"a release").hexdigest()
    (release / "oolong-9.9.10-py3-none-any.whl").write_bytes(b"another")
    with pytest.raises(builds.BuildError, match="exactly one oolong-"):
        builds.publish_build((tmp_path / "store").as_uri())
