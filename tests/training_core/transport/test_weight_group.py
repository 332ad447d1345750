"""The weight-update group is a communicator of its own, never a split of the trainer's.

DeepSpeed binds the trainer's default group to the rank's GPU when it has more than one rank;
torch then makes every new NCCL group by splitting the default communicator, a collective all
trainer ranks must join, while only rank 0 joins the weight group: a deadlock on the first push.
The creation arguments are checked here on a gloo default group bound to a (nominal) GPU, in a
fresh interpreter (the default group is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from training_core.ports import free_port
    from training_core.transport import weight_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    default = c10d._get_default_group()
    default.bound_device_id = torch.device("cuda", 0)  # what DeepSpeed's device_id leaves
    seen = []
    real = c10d._new_process_group_helper

    def spy(*args, **kwargs):
        # torch's own predicate for "split the new group from the default one"
        seen.append({"split": bool(dist.is_initialized()
                                   and c10d._get_default_group().bound_device_id)})
        return real(*args, **kwargs)

    c10d._new_process_group_helper = spy
    group = weight_group.init_weight_update_group(
        master_address="127.0.0.1", master_port=free_port(), rank=0, world_size=1,
        group_name="weights", backend="gloo", timeout_s=30)
    t = torch.ones(3)
    weight_group.broadcast_from_trainer(group, [t])
    print(json.dumps({"seen": seen, "after": str(default.bound_device_id),
                      "sent": t.tolist()}))
""")


def test_the_weight_group_is_created_without_splitting_the_trainers_bound_communicator():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # while the group was made the default group looked unbound: no split source, no split
    assert result["seen"] == [{"split": False}]
    # and it is bound again afterwards (the trainer's own collectives keep their device)
    assert result["after"] == "cuda:0"
    assert result["sent"] == [1.0, 1.0, 1.0]


BIND = textwrap.dedent("""
    import json, os, threading
    import psutil
    from training_core.ports import free_port
    from training_core.transport import weight_group

    port = free_port()
    group = weight_group.init_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=1,
        group_name="weights", backend="gloo", timeout_s=30)
    listening = [c.laddr.ip for c in psutil.Process(os.getpid()).net_connections()
                 if c.status == "LISTEN" and c.laddr.port == port]
    print(json.dumps(listening), flush=True)
    os._exit(0)
""")


def test_the_weight_groups_store_listens_only_on_the_address_it_was_given():
    """torch's TCPStore listened on every interface even when given 127.0.0.1: a stranger on
    the cluster network could join the weight group's rendezvous."""
    out = subprocess.run([sys.executable, "-c", BIND], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["127.0.0.1"]
