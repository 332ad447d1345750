"""Weight folders on disk (safetensors), written by the trainer and loaded by the rollout engines,
and the lock that lets the trainer write a new version over a retired one.

Why overwrite: writing SmolLM2's 540 MB (fp32) into a new file took 0.2-1.6 s (median 0.86 s)
on a 2-core VM, because every page of the page cache is allocated and zeroed and dirty-page
writeback competes with the writer; the same bytes written over a file whose pages are still
cached took 0.1 s (bf16: 0.43 against 0.10 s). So the ``disk`` sync keeps one retired version
as a spare (weight_sync.DiskSync) and :func:`save` casts the next version straight into it.

Why a lock: safetensors' ``load_file`` maps the file, and the engine takes the mapped tensors as
its parameters (``load_state_dict(assign=True)``, no copy), so a loaded file is read for as long
as its weights serve, not only while it loads. Every reader here holds a shared ``flock`` on the
file for as long as its tensors may be in use (:func:`load` returns a :class:`Held`); the writer
takes the exclusive lock without waiting and writes a new file when it cannot have it. SGLang
itself copies weights into its own parameters as it loads them, and a spare is two pushes old
before it is reused.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
from pathlib import Path
from typing import IO

import torch

FILE = "model.safetensors"
# safetensors' names of the dtypes a weight file may hold (its header's "dtype")
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class WeightLoadError(RuntimeError):
    """A weight update that cannot be applied (the reply says why; the old weights stay)."""


class Held:
    """Shared locks on the weight files whose mapped tensors are in use; :meth:`release` once
    they no longer are (a later load replaced them). Also released when garbage-collected."""

    def __init__(self) -> None:
        self._files: list[IO[bytes]] = []

    def add(self, file: IO[bytes]) -> None:
        self._files.append(file)

    def release(self) -> None:
        for f in self._files:
            f.close()  # closing the last descriptor drops the flock
        self._files = []


def load(folder: str | Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], Held]:
    """Every ``*.safetensors`` in ``folder``, each read while this process holds a shared lock
    on it, and the locks (keep them while the tensors serve). The file is read through the
    descriptor that holds the lock, so a folder replaced meanwhile cannot slip in another file."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors in {folder}")
    from safetensors.torch import load_file

    held, state = Held(), {}
    try:
        for path in files:
            f = open(path, "rb")  # noqa: SIM115 - kept open in `held`
            held.add(f)
            fcntl.flock(f, fcntl.LOCK_SH)
            state.update(load_file(f"/proc/self/fd/{f.fileno()}", device=str(device)))
    except BaseException:
        held.release()
        raise
    return state, held


def save(folder: str | Path, state: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
         spare: str | Path | None = None) -> Path:
    """Write ``state`` (cast to ``dtype`` where given) as ``folder/model.safetensors``, whole
    or not at all (a ``.tmp`` folder, then a rename). With ``spare``, a retired weight folder of
    the same tensors that nobody holds, the bytes are written over its file and the spare
    becomes ``folder``; otherwise (or when the spare is held, missing or of other tensors) a new
    file. Returns ``folder``."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if spare is not None and overwrite(Path(spare) / FILE, state, dtype):
        Path(spare).rename(tmp)
    else:
        from safetensors.torch import save_file

        tmp.mkdir(parents=True)
        save_file({k: v.to(dtype or v.dtype).cpu().contiguous() for k, v in state.items()},
                  str(tmp / FILE))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def overwrite(path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> bool:
    """Write ``state`` over the safetensors file ``path`` in place, each tensor cast on the way
    into the file's own bytes, under an exclusive lock taken without waiting. False, with the
    file untouched, where it is missing, held by a reader, or not laid out for exactly these
    names, dtypes and shapes."""
    try:
        f = open(path, "r+b")  # noqa: SIM115 - closed below
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        layout = _layout(f, state, dtype)
        if layout is None:
            return False
        with mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size) as mm:
            data = torch.frombuffer(mm, dtype=torch.uint8)
            try:
                for name, (start, end, kind) in layout.items():
                    data[start:end].view(kind).view(state[name].shape).copy_(state[name])
            finally:
                del data  # the map cannot close while a tensor still points into it
    return True


def _layout(f: IO[bytes], state: dict[str, torch.Tensor],
            dtype: torch.dtype | None) -> dict[str, tuple[int, int, torch.dtype]] | None:
    """Each tensor's byte range in the file and its dtype, when the file's header describes
    exactly ``state`` (cast to ``dtype``) within the file's size; otherwise None."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        return None
    n = int.from_bytes(head, "little")
    if n > min(MAX_HEADER, size - 8):
        return None
    try:
        header = json.loads(f.read(n))
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    header.pop("__metadata__", None)
    if header.keys() != state.keys():
        return None
    layout = {}
    for name, entry in header.items():
        want = state[name]
        kind = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if kind is None or kind != (dtype or want.dtype) or entry.get("shape") != list(want.shape):
            return None
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and o >= 0 for o in offsets)):
            return None
        start, end = (8 + n + o for o in offsets)
        if end - start != want.numel() * kind.itemsize or end > size:
            return None
        layout[name] = (start, end, kind)
    return layout
