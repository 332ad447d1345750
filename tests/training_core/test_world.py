"""The trainer's collectives under NCCL's rule: tensors on the group's device.

gloo takes CPU tensors, NCCL refuses them ("No backend type associated with device type cpu"),
so a CPU run can never show a misplaced tensor. Here the default group is declared NCCL and
``torch.distributed`` is replaced by a stand-in that records every collective and refuses, as
NCCL does, any tensor that is not on a GPU. No GPU exists here: ``torch.tensor(...,
device="cuda:N")`` inside world.py makes a CPU tensor that reports ``cuda:N`` (the one liberty
taken; everything else is world.py's own code).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from training_core import world

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

ROOT = Path(__file__).resolve().parents[2]


class _OnGpu(torch.Tensor):
    """A CPU tensor that reports the GPU it stands in for."""

    gpu: torch.device

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.gpu


class _TorchWithGpu:
    """``torch`` as world.py sees it, with tensors on ``cuda:N`` made as :class:`_OnGpu`."""

    def __init__(self, gpu: int):
        self.cuda = SimpleNamespace(current_device=lambda: gpu, set_device=lambda i: None)
        self.made: list[torch.device] = []

    def tensor(self, data, *, dtype=None, device=None):
        device = torch.device(device or "cpu")
        self.made.append(device)
        t = torch.tensor(data, dtype=dtype)
        if device.type == "cuda":
            t = t.as_subclass(_OnGpu)
            t.gpu = device
        return t

    def device(self, *args):
        return torch.device(*args)

    def __getattr__(self, name):
        return getattr(torch, name)


class _NcclStandIn:
    """The collectives of ``torch.distributed`` for a 2-rank NCCL group, recorded; a tensor off
    the GPU is refused with NCCL's own error."""

    class ReduceOp:
        SUM, MAX = "sum", "max"

    def __init__(self, backend: str = "nccl"):
        self.backend = backend
        self.calls: list[tuple[str, str]] = []

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self) -> int:
        return 0

    def get_world_size(self) -> int:
        return 2

    def get_backend(self, group=None) -> str:
        return self.backend

    def _check(self, name: str, device: torch.device) -> None:
        self.calls.append((name, str(device)))
        if self.backend == "nccl" and device.type != "cuda":
            raise RuntimeError(f"No backend type associated with device type {device.type}")

    def all_reduce(self, t, op=None, group=None):
        self._check("all_reduce", t.device)

    def broadcast_object_list(self, objects, src=0, group=None, device=None):
        self._check("broadcast_object_list", torch.device(device or "cpu"))

    def barrier(self, group=None, device_ids=None):
        self._check("barrier", torch.device("cuda", device_ids[0]) if device_ids else
                    torch.device("cpu"))

    def broadcast(self, t, group=None, group_src=0, async_op=False):
        self._check("broadcast", t.device)
        return SimpleNamespace(wait=lambda: None)


@pytest.fixture
def nccl(monkeypatch):
    fake = _NcclStandIn()
    fake_torch = _TorchWithGpu(gpu=3)
    monkeypatch.setattr(torch, "distributed", fake)
    monkeypatch.setitem(__import__("sys").modules, "torch.distributed", fake)
    monkeypatch.setattr(world, "torch", fake_torch)
    return SimpleNamespace(dist=fake, torch=fake_torch)


def test_the_stand_in_refuses_a_cpu_tensor_as_nccl_does(nccl):
    """The stand-in is what makes the next test mean something: NCCL's refusal, reproduced."""
    with pytest.raises(RuntimeError, match="device type cpu"):
        nccl.dist.all_reduce(torch.zeros(2))


def test_every_collective_of_the_trainer_puts_its_tensors_on_this_ranks_gpu(nccl):
    assert world.group_device() == torch.device("cuda", 3)
    assert world.all_reduce_sum([1.0, 2.0]) == [1.0, 2.0]  # a stand-in: nothing to add
    assert world.all_reduce_max([3.0]) == [3.0]
    assert world.broadcast_object({"batch": 1}) == {"batch": 1}
    world.barrier()
    assert nccl.dist.calls == [("all_reduce", "cuda:3"), ("all_reduce", "cuda:3"),
                               ("broadcast_object_list", "cuda:3"), ("barrier", "cuda:3")]
    assert all(d.type == "cuda" for d in nccl.torch.made)


def test_under_gloo_the_same_collectives_stay_on_the_cpu(nccl):
    nccl.dist.backend = "gloo"
    assert world.group_device() == torch.device("cpu")
    assert world.all_reduce_sum([1.0]) == [1.0]
    # a mixed backend routes CPU tensors to its gloo half
    nccl.dist.backend = "cpu:gloo,cuda:nccl"
    assert world.group_device() == torch.device("cpu")


def test_a_weight_broadcast_refuses_a_tensor_off_the_groups_device(nccl):
    """Weights are too big to copy behind the caller's back: a CPU tensor on an NCCL weight group
    is refused before any collective, naming the tensor and both devices."""
    with pytest.raises(ValueError, match=r"tensor 1 .* on cpu.*nccl.*cuda:3"):
        world.broadcast_tensors([nccl.torch.tensor([1.0], device="cuda:3"), torch.zeros(1)],
                                group="weights")
    assert nccl.dist.calls == []
    world.broadcast_tensors([nccl.torch.tensor([1.0], device="cuda:3")], group="weights")
    assert nccl.dist.calls == [("broadcast", "cuda:3")]


COLLECTIVE = re.compile(
    r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather\w*|broadcast\w*|reduce\w*|barrier|"
    r"gather\w*|scatter\w*|all_to_all\w*|send|recv|isend|irecv|monitored_barrier)\s*\(")


def test_no_code_but_world_py_calls_a_torch_distributed_collective():
    """One module owns the collectives, so one module decides where their tensors live."""
    found = []
    for path in [*(ROOT / "training_core").rglob("*.py"), *(ROOT / "platform").rglob("*.py")]:
        if path == ROOT / "training_core" / "world.py":
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if COLLECTIVE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not found, "collectives outside training_core/world.py:\n" + "\n".join(found)
    # the scan finds them where they are
    assert COLLECTIVE.search((ROOT / "training_core/world.py").read_text())
