"""Commands for the processes of a run: rollout servers and the trainer (DeepSpeed launcher)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from orchestration.providers.base import NodeInventory


def trainer_command(spec_path: Path, server_urls: list[str], inventory: NodeInventory,
                    run_dir: Path, *, resume: bool = False) -> list[str]:
    """`deepspeed` launcher running `python -m training_core.cli train` over all GPUs of the
    inventory (a hostfile when there are several nodes); one process runs directly."""
    train_args = ["train", "--no-progress"]
    train_args += ["--resume", str(run_dir)] if resume else ["--config", str(spec_path)]
    train_args += [f"rollout.server_urls=[{','.join(server_urls)}]", "metrics.report_status=false"]
    processes = sum(max(n.gpus, 1) for n in inventory.nodes)
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent) + os.pathsep
                            + os.environ.get("PATH", ""))
    if processes == 1 or launcher is None:
        # One process needs no launcher (the DeepSpeed engine still runs, world size 1), and the
        # flow then sees the trainer's own exit status (e.g. killed by SIGKILL).
        return [sys.executable, "-m", "training_core.cli", *train_args]
    cmd = [launcher]
    if len(inventory.nodes) > 1:
        hostfile = run_dir / "hostfile"
        hostfile.write_text(inventory.hostfile())
        cmd += ["--hostfile", str(hostfile), "--master_addr",
                inventory.head.private_address or inventory.head.address]
    else:
        cmd += ["--num_gpus", str(max(inventory.head.gpus, 1))]
    return [*cmd, "--no_local_rank", "--module", "training_core.cli", *train_args]
