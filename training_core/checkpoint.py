"""Where checkpoints live and which one to resume from."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

STEP_TAG = re.compile(r"^step(\d+)$")
# Written last into a checkpoint folder: one without it was interrupted and is ignored.
COMPLETE = "COMPLETE"


def pushed_weights(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The weight folders pushed to the rollout servers, ``weights/v<version>``, oldest first."""
    found = []
    for d in (Path(run_dir) / "weights").glob("v*"):
        # full weights, or a LoRA adapter's folder (trainer/adapter.py: peft's file name)
        if d.name[1:].isdigit() and ((d / "model.safetensors").exists()
                                     or (d / "adapter_model.safetensors").exists()):
            found.append((int(d.name[1:]), d))
    return sorted(found)


CURRENT_WEIGHTS = "CURRENT"  # in weights/: the version the servers hold, and its folder


def current_weights(run_dir: str | Path) -> tuple[int, Path] | None:
    """The weights the servers hold, as the last completed push recorded them (``disk`` sync:
    weight_sync.DiskSync writes it): what a restarted server loads. None before the first push.
    The version comes from the trainer's record, never from folder names."""
    try:
        data = json.loads((Path(run_dir) / "weights" / CURRENT_WEIGHTS).read_text())
    except (OSError, ValueError):
        return None
    return int(data["version"]), Path(data["path"])


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_tags(names: Iterable[str], is_complete: Callable[[str], bool]) -> list[tuple[int, str]]:
    """``(step, tag)`` of the ``step<N>`` entries whose ``COMPLETE`` marker exists, oldest first
    (the rule for a run directory and for the durable store alike)."""
    found = []
    for name in names:
        m = STEP_TAG.match(name)
        if m and is_complete(name):
            found.append((int(m.group(1)), name))
    return sorted(found)


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, str]]:
    root = checkpoint_dir(run_dir)
    if not root.exists():
        return []
    return complete_tags((d.name for d in root.iterdir()),
                         lambda tag: (root / tag / COMPLETE).exists())


def latest_checkpoint(run_dir: str | Path) -> tuple[int, str] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    for _, tag in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(checkpoint_dir(run_dir) / tag, ignore_errors=True)
