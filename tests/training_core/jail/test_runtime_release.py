"""A root caller's image tmpfs outlives the process that mounted it
(``training_core/jail/runtime.py``), and a directory holding one cannot be removed: a CI run on a
machine where a clean-clone run had left one under ``/tmp/oolong-tests-platform`` errored on every
test's setup (pytest could not empty its ``--basetemp``). ``release_images`` unmounts them; the
test session calls it on its temporary directory (tests/conftest.py), scripts/test.sh on the
checkout's cache."""

from __future__ import annotations

import os
import shutil

import pytest

from training_core.jail import runtime

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only a root caller mounts a tmpfs")


def test_an_image_tmpfs_below_a_directory_is_released_and_the_directory_then_removed(
        tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    mine = tmp_path / "mine"
    monkeypatch.setenv("OOLONG_CACHE", str(elsewhere))
    kept = runtime.images_root()
    monkeypatch.setenv("OOLONG_CACHE", str(mine / "node" / "cache"))
    root = runtime.images_root()
    try:
        (root / "py-image").mkdir()
        assert runtime._is_tmpfs_mount(root) and runtime._is_tmpfs_mount(kept)
        # What pytest does to a --basetemp it finds: it cannot, while the tmpfs is there.
        shutil.rmtree(mine, ignore_errors=True)
        assert mine.exists()

        assert runtime.release_images(mine) == [str(root)]
        assert not runtime._is_tmpfs_mount(root)
        assert runtime._is_tmpfs_mount(kept)  # only what is under the directory given
        shutil.rmtree(mine)
        assert not mine.exists()
        assert runtime.release_images(mine) == []
    finally:
        runtime.release_images(tmp_path)
    assert not runtime._is_tmpfs_mount(kept)
