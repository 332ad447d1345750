"""Where checkpoints live and which one to resume from."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

STEP_TAG = re.compile(r"^step(\d+)$")


def pushed_weights(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The weight folders pushed to the rollout servers, ``weights/v<version>``, oldest first."""
    found = []
    for d in (Path(run_dir) / "weights").glob("v*"):
        if d.name[1:].isdigit() and (d / "model.safetensors").exists():
            found.append((int(d.name[1:]), d))
    return sorted(found)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, str]]:
    root = checkpoint_dir(run_dir)
    found = []
    if root.exists():
        for d in root.iterdir():
            m = STEP_TAG.match(d.name)
            if m and (d / "COMPLETE").exists():
                found.append((int(m.group(1)), d.name))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, str] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    for _, tag in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(checkpoint_dir(run_dir) / tag, ignore_errors=True)
