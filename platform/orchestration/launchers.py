"""Commands and environment for the processes of a run: rollout servers and the trainer, on this
machine (the training-run flow) or on a node (flows/node_processes.py)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from orchestration.providers.base import NodeInventory
from training_core.config import RunSpec
from training_core.launch import embedded_server_command, sglang_server_command
from training_core.processes import process_env


def run_env(run_dir: Path, run_id: int | None = None) -> dict[str, str]:
    """The allow-listed environment of a run's processes, with the run directory importable
    (user reward modules are written there) and the run id that marks them."""
    path = os.pathsep.join(p for p in [str(run_dir), os.environ.get("PYTHONPATH", "")] if p)
    extra = {"PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if run_id is not None:
        extra["OOLONG_RUN_ID"] = str(run_id)
    return process_env(extra)


def server_command(spec: RunSpec, model_dir: str, port: int, index: int, *,
                   host: str | None = None, parent_pid: int | None = None) -> list[str]:
    """Rollout server ``index`` of the run: SGLang or the embedded server (each binds to its own
    default address unless ``host`` is given)."""
    where = {"host": host} if host else {}
    if spec.rollout.backend == "sglang":
        return sglang_server_command(model_dir, port, **where)
    return embedded_server_command(model_dir, port, threads=spec.rollout.server_threads,
                                   max_batch_size=spec.rollout.max_batch_size,
                                   seed=spec.seed + index, parent_pid=parent_pid, **where)


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
    """What a warm start depends on: the model, the data (a file by its content) and the seed."""
    data = spec.data.model_dump(mode="json")
    kind, _, where = spec.data.source.partition(":")
    if Path(where).is_file():
        data["source"] = f"{kind}:sha256:{hashlib.sha256(Path(where).read_bytes()).hexdigest()}"
    blob = json.dumps({"model": spec.model.model_dump(mode="json"), "data": data,
                       "seed": spec.seed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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


def train_args(spec_path: Path, server_urls: list[str], run_dir: Path, *,
               resume: bool = False) -> list[str]:
    """``oolong train`` arguments for a flow-started trainer: the prepared spec (or the run
    directory on resume), the run's servers, status reported by the flow."""
    source = ["--resume", str(run_dir)] if resume else ["--config", str(spec_path)]
    return ["train", "--no-progress", *source,
            f"rollout.server_urls=[{','.join(server_urls)}]", "metrics.report_status=false"]


def trainer_command(spec_path: Path, server_urls: list[str], inventory: NodeInventory,
                    run_dir: Path, *, resume: bool = False) -> list[str]:
    """`deepspeed` launcher running `python -m training_core.cli train` over all GPUs of the
    inventory (a hostfile when there are several nodes); one process runs directly."""
    args = train_args(spec_path, server_urls, run_dir, resume=resume)
    processes = sum(max(n.gpus, 1) for n in inventory.nodes)
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent) + os.pathsep
                            + os.environ.get("PATH", ""))
    if processes == 1 or launcher is None:
        # One process needs no launcher (the DeepSpeed engine still runs, world size 1), and the
        # flow then sees the trainer's own exit status (e.g. killed by SIGKILL).
        return [sys.executable, "-m", "training_core.cli", *args]
    cmd = [launcher]
    if len(inventory.nodes) > 1:
        hostfile = run_dir / "hostfile"
        hostfile.write_text(inventory.hostfile())
        cmd += ["--hostfile", str(hostfile), "--master_addr",
                inventory.head.private_address or inventory.head.address]
    else:
        cmd += ["--num_gpus", str(max(inventory.head.gpus, 1))]
    return [*cmd, "--no_local_rank", "--module", "training_core.cli", *args]
