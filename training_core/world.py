"""The trainer's world: its ranks, and every collective the trainer's processes make.

One module owns them so that the rule NCCL imposes is decided once: a collective's tensors live
on the group's device (``cuda:<local rank>`` under NCCL, the CPU under gloo). gloo accepts CPU
tensors where NCCL refuses them ("No backend type associated with device type cpu"), so a CPU
test run would never see a misplaced tensor; here every tensor is placed by :func:`group_device`,
and a test declares an NCCL group with a recording stand-in to check it. Nothing else in
training_core calls a ``torch.distributed`` collective (a test greps for it).
"""

from __future__ import annotations

import os

import torch


def init_distributed(backend: str = "auto") -> None:
    """The trainer's default group (DeepSpeed's), once per process; ``auto``: NCCL on GPUs."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _init_default_group(backend)
    if "nccl" in str(dist.get_backend()).lower():
        # Collectives and object broadcasts use the current device under NCCL: this rank's GPU.
        torch.cuda.set_device(local_rank())


def _init_default_group(backend: str) -> None:
    import deepspeed

    from training_core.ports import free_port

    # Single process by default; under the deepspeed launcher these are already set. The
    # rendezvous address we set is removed afterwards: child processes (a trainer started from
    # here) must not inherit a port that this process's store already holds. DeepSpeed reads
    # LOCAL_RANK later, so the ranks stay.
    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    added = [k for k in defaults if k not in os.environ]
    for k in added:
        os.environ[k] = defaults[k]
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    finally:
        for k in set(added) & {"MASTER_ADDR", "MASTER_PORT"}:
            os.environ.pop(k, None)


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_rank() -> int:
    """This process's rank on its node (the launchers set ``LOCAL_RANK``; 0 alone)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def group_device(group: object | None = None) -> torch.device:
    """Where a collective's tensors must live for ``group`` (default: the trainer's): this
    rank's GPU when the group's backend has no CPU path (NCCL), the CPU otherwise (gloo, or a
    ``cpu:gloo,cuda:nccl`` pair, which takes CPU tensors to gloo)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for every trainer rank (nothing to wait for with one process)."""
    if rank_and_world()[1] > 1:
        import torch.distributed as dist

        device = group_device()
        # NCCL's barrier runs on a device: name ours, or it guesses one from the rank.
        dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()


def finish_distributed() -> None:
    """Leave together and tear the default group down: a rank that exits while another still
    holds its gloo pair can abort at exit, and the launcher then reports a finished run as
    failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: list[float]) -> list[float]:
    """``values`` summed over the ranks (every rank calls it with as many values)."""
    return _all_reduce(values, "SUM")


def all_reduce_max(values: list[float]) -> list[float]:
    """``values``' maxima over the ranks."""
    return _all_reduce(values, "MAX")


def _all_reduce(values: list[float], op: str) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=group_device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank (picklable objects). torch pickles it into a byte
    tensor on the device it takes as current for NCCL: ``init_distributed`` made that this
    rank's GPU."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, device=group_device())
    return box[0]


def broadcast_tensors(tensors: list[torch.Tensor], group: object, src: int = 0) -> None:
    """Each of ``tensors`` from ``src`` of ``group`` (a weight-update group: the trainer sends,
    servers receive into tensors they allocated), in order, all in flight at once. Every tensor
    must already be on the group's device: these are weights, too big to copy here, so a
    misplaced one is refused as NCCL would refuse it, naming the tensor and both devices."""
    import torch.distributed as dist

    device = group_device(group)
    for i, t in enumerate(tensors):
        if t.device.type != device.type:
            raise ValueError(f"tensor {i} of the broadcast is on {t.device}, but the group's "
                             f"backend ({dist.get_backend(group)}) takes tensors on {device}")
    handles = [dist.broadcast(t, group=group, group_src=src, async_op=True) for t in tensors]
    for h in handles:
        h.wait()
