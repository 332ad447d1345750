"""The run's supervised warm start (``oolong sft``), on this machine or a node. Every process
command and environment comes from the one launcher, ``training_core/launch.py``."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from training_core.config import RunSpec
from training_core.launch import run_env


def warm_start(spec: RunSpec, spec_path: Path, run_dir: Path, run_id: int | None = None, *,
               share: Path | None = None) -> Path | None:
    """The spec's supervised warm start (``oolong sft``) into ``run_dir/initial_model``, where
    the run's processes start from (``run_model_dir``); None when the spec has none. Bounded by
    ``model.warm_start_seconds`` and, when set, ``model.warm_start_steps``.

    ``share``: a folder the runs of a sweep share on this machine. Runs whose warm-start inputs
    agree (model, data, seed: :func:`warm_start_key`) make it once, under a lock, and each takes
    a copy (hard links where it can), so the sweep's runs start from the same weights."""
    out = run_dir / "initial_model"
    if (out / "config.json").exists():
        return out
    if spec.model.warm_start_seconds <= 0:
        return None
    log = run_dir / "logs" / "warm-start.log"
    if share is None:
        _sft(spec, spec_path, out, log, run_dir, run_id)
        return out
    shared = share / f"warm-start-{warm_start_key(spec)}"
    share.mkdir(parents=True, exist_ok=True)
    with (share / f"{shared.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first run makes it; the others wait, then copy
        if not (shared / "config.json").exists():
            _sft(spec, spec_path, shared, log, run_dir, run_id)
    tmp = run_dir / ".initial_model.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(shared, tmp, copy_function=_link_or_copy)
    tmp.rename(out)
    return out


def warm_start_key(spec: RunSpec) -> str:
    """What a warm start depends on: the model, the data and the named eval sets (whose
    questions it leaves out; a file by its content) and the seed."""
    blob = json.dumps({"model": spec.model.model_dump(mode="json"), "data": _by_content(spec.data),
                       "eval_sets": [_by_content(s) for s in spec.eval.sets],
                       "seed": spec.seed, "eval_size": spec.eval.size if spec.eval.sets else None},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _by_content(section: Any) -> dict[str, Any]:
    """A spec section with its ``source`` file named by its content's hash, not its path."""
    data = section.model_dump(mode="json")
    kind, _, where = section.source.partition(":")
    if Path(where).is_file():
        data["source"] = f"{kind}:sha256:{hashlib.sha256(Path(where).read_bytes()).hexdigest()}"
    return data


def _sft(spec: RunSpec, spec_path: Path, out: Path, log: Path, run_dir: Path,
         run_id: int | None) -> None:
    """``oolong sft`` into ``out``, through a temporary folder: a warm start that dies half way
    never looks finished."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = spec.model.warm_start_steps or 1_000_000
    with log.open("w") as fh:
        subprocess.run([sys.executable, "-m", "training_core.cli", "sft", "--no-progress",
                        "--config", str(spec_path), "--out", str(tmp), "--steps", str(steps),
                        "--seconds", str(spec.model.warm_start_seconds)],
                       check=True, env=run_env(run_dir, run_id), stdout=fh,
                       stderr=subprocess.STDOUT)
    tmp.rename(out)


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
