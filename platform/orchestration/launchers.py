"""Commands for the processes of a run: rollout servers and the trainer (DeepSpeed launcher)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from orchestration.providers.base import NodeInventory


def trainer_command(spec_path: Path, server_urls: list[str], inventory: NodeInventory,
                    run_dir: Path, *, resume: bool = False) -> list[str]:
    """`deepspeed` launcher running `python -m training_core.cli train`; a hostfile when the
    inventory has several nodes. On a single CPU node one process (gloo)."""
    train_args = ["train", "--no-progress"]
    train_args += ["--resume", str(run_dir)] if resume else ["--config", str(spec_path)]
    train_args += [f"rollout.server_urls=[{','.join(server_urls)}]", "metrics.report_status=false"]
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent) + os.pathsep
                            + os.environ.get("PATH", ""))
    if launcher is None:
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
