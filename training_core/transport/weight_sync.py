"""How new weights reach the rollout servers (``weight_sync`` in the run spec).

Two steps, split because they run at different moments of the loop (train.py):

1. ``export(trainer, version)`` right after the update, on every trainer rank (under ZeRO-3 the
   full weights are a gather all ranks join), while generation keeps running.
2. ``push(client, version)`` on rank 0 only, while the servers are paused: always through
   :func:`push_weights`, the one place that pauses generation, pushes, advances the policy
   version (its owner: training_core.version) and resumes.

``disk``: export writes safetensors under the run directory, push is SGLang's
``/update_weights_from_disk`` with its path. A LoRA run (``model.lora``) exports the adapter
alone (peft's layout) and pushes it with ``/load_lora_adapter`` under the name ``v<version>``,
then unloads the older adapters no request in flight names (docs/lora.md). Needs a filesystem the servers share with the trainer.
A folder two versions old is kept as ``weights/.spare`` and the next export is written over its
file (weight_files: 5-12x faster than a new file for SmolLM2 in fp32 on a 2-core VM).

``distributed``: SGLang's distributed weight update, over the network. Rank 0 and every server
join one process group (``/init_weights_update_group``: world = 1 + the servers' tensor-parallel
sizes, server i at rank offset 1 + the sizes before it). A push announces a bucket of tensors
(``/update_weights_from_distributed`` with names, dtypes, shapes) and broadcasts them from rank 0
in exactly that order, bucket after bucket; the last bucket carries the new ``weight_version``.
By default a bucket travels as one flat byte buffer (SGLang's ``load_format:
"flattened_bucket"``), flattened at export time so the pause holds only the transfer. Backend
gloo for CPU tensors, nccl for CUDA ones. Nothing touches a disk. A LoRA run broadcasts its
adapter's tensors alone (peft's names, on the trainer's device as the full weights would be), then
``/load_lora_adapter_from_tensors`` names them ``v<version>`` with the adapter's config and no
tensors in the request (the embedded server only: SGLang 0.5.23 loads no adapter from the group,
so the spec refuses that pair), and the older adapters are unloaded as over disk.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import torch

from training_core.api import RolloutServerError, TrainEngine, WeightReceiver
from training_core.checkpoint import CURRENT_WEIGHTS, pushed_weights
from training_core.dtypes import wire_name
from training_core.ports import NODE_ADDRESS_ENV, free_port
from training_core.transport.weight_group import (
    DEFAULT_GROUP_NAME,
    backend_for,
    broadcast_from_trainer,
    destroy_weight_update_group,
    flatten,
    init_weight_update_group,
)
from training_core.version import PolicyVersion

ADAPTER_FILE = "adapter_model.safetensors"  # peft's name (trainer/adapter.py writes it)
SPARE = ".spare"  # in weights/: a retired version's folder, to be written over (DiskSync)
BUCKET_BYTES = 1 << 30  # per /update_weights_from_distributed call: bounds a server's staging


class WeightSync(Protocol):
    def export(self, trainer: TrainEngine, version: int, *, resumed: bool = False) -> None: ...
    async def connect(self, client: WeightReceiver) -> None: ...
    async def push(self, client: WeightReceiver, version: int) -> None: ...
    async def close(self, client: WeightReceiver) -> None: ...


async def push_weights(client: WeightReceiver, sync: WeightSync, policy: PolicyVersion, *,
                       advance: bool = True) -> int:
    """Pause generation, push the exported weights of the next version, advance the version,
    resume; returns the version the servers now hold. Generation is paused for the transfer
    only: in-flight requests abort and the client re-submits them with their partial output
    once it resumes. ``advance=False`` brings the servers to the current version (a resume)."""
    version = policy.current + (1 if advance else 0)
    await client.pause()
    try:
        await sync.push(client, version)
        if advance:
            policy.advance()
    finally:
        await client.resume()
    return version


def adapter_name(version: int) -> str:
    """The name a LoRA run's adapter of ``version`` is loaded under on the servers."""
    return f"v{version}"


def make_weight_sync(kind: str, run_dir: Path) -> WeightSync:
    if kind == "disk":
        return DiskSync(run_dir / "weights")
    if kind == "distributed":
        return DistributedSync()
    raise ValueError(f"weight_sync: unknown kind {kind!r} (disk or distributed)")


class DiskSync:
    def __init__(self, root: Path, *, reuse: bool = True):
        self.root = root
        self.reuse = reuse  # False: every export a new file (benchmarks/weight_sync.py compares)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def export(self, trainer: TrainEngine, version: int, *, resumed: bool = False) -> None:
        if resumed:  # see below
            self._forget()
        trainer.save_weights(self.path(version), spare=self.root / SPARE if self.reuse else None)

    def _forget(self) -> None:
        """A resumed run's folders start afresh: the versions above its checkpoint's are a
        discarded future, and after a machine crash any folder written in place in the last
        seconds may hold older bytes (nothing is flushed before its rename). Checkpoints, not
        these folders, are the record. CURRENT names a removed folder until the resume's push."""
        for _, d in pushed_weights(self.root.parent):
            shutil.rmtree(d, ignore_errors=True)
        for d in [self.root / SPARE, *self.root.glob("v*.tmp")]:
            shutil.rmtree(d, ignore_errors=True)

    async def connect(self, client: WeightReceiver) -> None:
        return None

    async def push(self, client: WeightReceiver, version: int) -> None:
        path = self.path(version).resolve()
        if (path / ADAPTER_FILE).exists():  # [issue 49] a LoRA run: the adapter alone
            await client.load_lora_adapter(adapter_name(version), str(path), version)
            await client.unload_unused_adapters()
        else:
            await client.update_weights_from_disk(str(path), version)
        tmp = self.root / f".{CURRENT_WEIGHTS}.tmp"  # written whole, then renamed: never half a record
        tmp.write_text(json.dumps({"version": version, "path": str(path)}))
        os.replace(tmp, self.root / CURRENT_WEIGHTS)
        # Keep the live version and the one before (a server may still be reading it); the
        # newest older one becomes the spare the next export writes over.
        retired = [d for v, d in pushed_weights(self.root.parent) if v < version - 1]
        if retired:
            shutil.rmtree(self.root / SPARE, ignore_errors=True)
            newest = retired.pop()
            try:
                newest.rename(self.root / SPARE)
            except OSError:  # the old spare not fully gone (an NFS .nfsXXXX): no spare this time
                retired.append(newest)
        for d in retired:
            shutil.rmtree(d, ignore_errors=True)

    async def close(self, client: WeightReceiver) -> None:
        shutil.rmtree(self.root / SPARE, ignore_errors=True)  # a model's size of disk, no use now


@dataclass
class _Bucket:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    tensors: list[torch.Tensor]  # one flat uint8 buffer when flattened


class DistributedSync:
    def __init__(self, *, group_name: str = DEFAULT_GROUP_NAME, bucket_bytes: int = BUCKET_BYTES,
                 flatten: bool = True, timeout_s: float = 300.0):
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        # SGLang's load_format "flattened_bucket": one broadcast per bucket, not per tensor.
        self.flatten = flatten
        self.timeout_s = timeout_s
        self.group: torch.distributed.ProcessGroup | None = None
        self._buckets: list[_Bucket] = []
        self._flat: list[torch.Tensor] = []
        self._version: int | None = None
        self._adapter_config: dict | None = None  # a LoRA run's: what its buckets hold
        self.pushed_bytes = 0  # of the last push (benchmarks, tests)

    def export(self, trainer: TrainEngine, version: int, *, resumed: bool = False) -> None:
        """Every rank (a collective under ZeRO-3); rank 0 keeps the bucketed weights. The flat
        copies are made here, while generation still runs, not in the pause."""
        from training_core.world import rank_and_world

        # [issue 49] a LoRA run sends its adapter alone (ZeRO 0-2 only: no collective); the
        # servers hold its tensors until /load_lora_adapter_from_tensors names them
        adapter = trainer.adapter_weights() if hasattr(trainer, "adapter_weights") else None
        weights = adapter[0] if adapter is not None else trainer.weights()
        if rank_and_world()[0] != 0:
            return
        self._adapter_config = adapter[1] if adapter is not None else None
        buckets = _buckets(list(weights.items()), self.bucket_bytes)
        # The flat buffers are reused from version to version (already paged in).
        self._flat = [flatten([t for _, t in b], out=self._flat[i] if i < len(self._flat) else None)
                      for i, b in enumerate(buckets)] if self.flatten else []
        self._buckets = [
            _Bucket([n for n, _ in b], [wire_name(t.dtype) for _, t in b], [list(t.shape) for _, t in b],
                    [self._flat[i]] if self.flatten else [t.contiguous() for _, t in b])
            for i, b in enumerate(buckets)]
        self._version = version

    @property
    def device(self) -> torch.device:
        if self._buckets:
            return self._buckets[0].tensors[0].device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    async def connect(self, client: WeightReceiver) -> None:
        """Build the group: the servers' joins and rank 0's own, concurrently (each blocks until
        every rank is in). Call again after a server restarts (it lost its membership)."""
        await self.close(client)
        tp = await client.tp_sizes()
        offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
        world = 1 + sum(tp)
        address = node_address(client.urls[0])
        port = free_port()
        backend = backend_for(self.device)
        own = _ThreadResult(functools.partial(
            init_weight_update_group, master_address=address, master_port=port, rank=0,
            world_size=world, group_name=self.group_name, backend=backend,
            timeout_s=self.timeout_s))
        joins = asyncio.ensure_future(client.init_weights_update_group(
            master_address=address, master_port=port, rank_offsets=offsets, world_size=world,
            group_name=self.group_name, backend=backend))
        await _both(joins, own, "init_weights_update_group")
        self.group = own.result()

    async def push(self, client: WeightReceiver, version: int) -> None:
        if self.group is None:
            raise RolloutServerError("weight_sync distributed: no weight update group (connect)")
        if self._version != version:
            raise RuntimeError(f"weights of version {self._version} exported, {version} pushed")
        # A restarted server lost its membership (it reports the version it started at): the
        # group is rebuilt before the push, or its broadcast would wait for a rank that is gone.
        versions = await client.weight_versions()
        if any(v != str(client.version) for v in versions):
            await self.connect(client)
        adapter = self._adapter_config
        async with client.weight_update_session():
            for i, bucket in enumerate(self._buckets):
                # an adapter's version comes with its load (below), and the base is unchanged:
                # nothing to flush
                last = i == len(self._buckets) - 1 and adapter is None
                announce = asyncio.ensure_future(client.update_weights_from_distributed(
                    names=bucket.names, dtypes=bucket.dtypes, shapes=bucket.shapes,
                    group_name=self.group_name, version=version if last else None,
                    flush_cache=last and client.flush_cache,
                    load_format="flattened_bucket" if self.flatten else None))
                sent = _ThreadResult(functools.partial(broadcast_from_trainer, self.group,
                                                       bucket.tensors))
                await _both(announce, sent, "update_weights_from_distributed")
        if adapter is not None:
            await client.load_lora_adapter_from_tensors(adapter_name(version), adapter, version)
            await client.unload_unused_adapters()
        self.pushed_bytes = sum(t.numel() * t.element_size() for b in self._buckets
                                for t in b.tensors)
        self._buckets = []

    async def close(self, client: WeightReceiver) -> None:
        if self.group is None:
            return
        await client.destroy_weights_update_group(self.group_name)
        destroy_weight_update_group(self.group)
        self.group = None


def node_address(server_url: str) -> str:
    """The address the servers reach this trainer at: ``$OOLONG_NODE_ADDRESS``, else the local
    address of the route to the first server (no packet is sent)."""
    if os.environ.get(NODE_ADDRESS_ENV):
        return os.environ[NODE_ADDRESS_ENV]
    parsed = urlparse(server_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parsed.hostname or "127.0.0.1", parsed.port or 80))
        return s.getsockname()[0]


def _buckets(items: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
    return buckets


class _ThreadResult:
    """A blocking collective run on a daemon thread (a broadcast that a dead server never joins
    must not keep the process alive at exit), awaitable from the control loop."""

    def __init__(self, fn):
        self._loop = asyncio.get_running_loop()
        self.future: asyncio.Future = self._loop.create_future()
        threading.Thread(target=self._run, args=(fn,), daemon=True, name="weight-sync").start()

    def _run(self, fn) -> None:
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            self._loop.call_soon_threadsafe(_settle, self.future, None, exc)
        else:
            self._loop.call_soon_threadsafe(_settle, self.future, value, None)

    def result(self):
        return self.future.result()


def _settle(future: asyncio.Future, value, exc) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


async def _both(http: asyncio.Future, local: _ThreadResult, call: str) -> None:
    """Wait for the servers' replies and rank 0's side; the first failure fails the sync (the
    other side may be stuck in the collective until the group's timeout)."""
    done, _ = await asyncio.wait([http, local.future], return_when=asyncio.FIRST_EXCEPTION)
    for f in done:
        if f.exception() is not None:
            http.cancel()
            exc = f.exception()
            if isinstance(exc, RolloutServerError):
                raise exc
            raise RolloutServerError(f"{call}: {type(exc).__name__}: {exc}") from exc
    await http
    await local.future
