"""The process group that carries weights from trainer rank 0 to the rollout servers.

SGLang's ``/init_weights_update_group`` builds it with its ``init_custom_process_group``: a
``tcp://master_address:master_port`` rendezvous (the trainer's rank 0 hosts the store), the store
prefixed with the group name, and a backend created beside (not inside) the default process
group, so a trainer that already has its own data-parallel group can join it too. Both sides
here build it the same way, so the trainer can talk to a real SGLang server and the embedded
server behaves like one.

World: rank 0 is the trainer, server ``i`` holds ranks ``rank_offset .. rank_offset + tp - 1``.
The backend is gloo for CPU tensors and nccl for CUDA ones (one code path, chosen by device).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from training_core import world

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default for every *WeightsUpdateGroup* call


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_weight_update_group(*, master_address: str, master_port: int, rank: int,
                             world_size: int, group_name: str = DEFAULT_GROUP_NAME,
                             backend: str = "gloo", timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Join the group; blocks until all ``world_size`` ranks have joined (or the timeout)."""
    timeout = timedelta(seconds=timeout_s)
    # The store torch's tcp:// rendezvous would make, built directly: under torchrun that
    # rendezvous hands rank 0 a client of the launcher's store (TORCHELASTIC_USE_AGENT_STORE)
    # instead of hosting this group's own, and nobody would listen at master_port.
    # Rank 0 hosts the store on the address it was given, not on every interface (torch's
    # TCPStore binds "::" by itself): the socket is bound here and handed over.
    listen_fd = _listening_fd(master_address, master_port) if rank == 0 else None
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False, master_listen_fd=listen_fd,
                          use_libuv=True)
    store = dist.PrefixStore(group_name, store)
    with _default_group_unbound():
        group, _ = c10d._new_process_group_helper(
            world_size, rank, [], dist.Backend(backend), store, group_name=group_name,
            timeout=timeout)
    # Group ranks are global ranks in this group's own world (what broadcast's ``src`` means).
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _listening_fd(address: str, port: int) -> int:
    """A listening TCP socket on ``address:port`` whose descriptor the store takes over."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


@contextmanager
def _default_group_unbound() -> Iterator[None]:
    """The trainer's default group, seen as not bound to a device while the weight group is made.

    DeepSpeed binds the trainer's default group to the rank's GPU (``device_id``) when it has more
    than one rank, and torch then makes every new NCCL group by ``ncclCommSplit`` of the default
    communicator: a split all the trainer's ranks must join, while only rank 0 joins this group,
    so rank 0 would wait forever. The weight group shares no rank with the trainer's group but
    rank 0, so it must be a communicator of its own (NVIDIA-NeMo/RL#3189 does the same)."""
    default = c10d._world.default_pg if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def destroy_weight_update_group(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.destroy_process_group(group)


def broadcast_from_trainer(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """One broadcast per tensor, in order, from rank 0 (the trainer sends, servers receive into
    the tensors they allocated from ``names``/``dtypes``/``shapes``)."""
    world.broadcast_tensors(tensors, group, src=0)


# SGLang's ``load_format: "flattened_bucket"``: a bucket's tensors travel as one uint8 buffer,
# each tensor's bytes back to back in ``names`` order (its FlattenedTensorBucket): one collective
# per bucket instead of one per tensor.

def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return math.prod(int(d) for d in shape) * dtype.itemsize


def flatten(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if out is not None and out.numel() == sum(p.numel() for p in parts):
        return torch.cat(parts, out=out)
    return torch.cat(parts)


def flat_nbytes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> int:
    return sum(_nbytes(d, s) for d, s in zip(dtypes, shapes, strict=True))


def unflatten(flat: torch.Tensor, dtypes: list[torch.dtype],
              shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views into ``flat`` (no copy), one per announced tensor."""
    out, start = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        end = start + _nbytes(dtype, shape)
        out.append(flat[start:end].view(dtype).reshape(shape))
        start = end
    return out
