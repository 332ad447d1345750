"""Weight folders on disk (safetensors), written by the trainer and loaded by the rollout engines,
and the lock that lets the trainer write a new version over a retired one.

Why overwrite: writing SmolLM2's 540 MB (fp32) into a new file took 0.2-2.3 s on 2-core VMs,
because every page of the page cache is allocated and zeroed and dirty-page writeback competes
with the writer; the same bytes written over a file whose pages are still cached took 0.1-0.2 s
(benchmarks/weight_sync.py, ``disk_fresh_export_s`` against ``disk_export_s``: 2.27 against
0.19 s; in a training run 0.7-2.0 against 0.13-0.36 s a step). So the ``disk`` sync keeps one
retired version as a spare (weight_sync.DiskSync) and :func:`save` writes the next version over
it, casting fp32 master weights on the way where the trainer has not made a copy already.

Durability: the bytes are not flushed before the rename (neither were a new file's). A process
crash is safe; after a machine crash a folder written in place may hold bytes of an older
version, so a resumed run removes the folders (DiskSync) and exports its checkpoint's weights
anew.

Why a lock: safetensors' ``load_file`` maps the file, and the engine takes the mapped tensors as
its parameters (``load_state_dict(assign=True)``, no copy), so a loaded file is read for as long
as its weights serve, not only while it loads. Every reader here holds a shared ``flock`` on the
file for as long as its tensors may be in use (:func:`load` returns a :class:`Held`); the writer
takes the exclusive lock without waiting and writes a new file when it cannot have it. SGLang
itself copies weights into its own parameters as it loads them, and a spare is two pushes old
before it is reused. The lock reaches readers on other machines only where the shared file
system passes ``flock`` between them (NFSv4 does; a ``local_lock`` mount does not); where
``flock`` fails outright, readers copy the weights and the writer never reuses a file.
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

    @staticmethod
    def merge(*helds: Held | None) -> Held:
        """One holder of all their locks (the parameters map files of each)."""
        out = Held()
        for h in helds:
            if h is not None:
                out._files.extend(h._files)
        return out

    def release(self) -> None:
        for f in self._files:
            f.close()  # closing the last descriptor drops the flock
        self._files = []


def load(folder: str | Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], Held]:
    """Every ``*.safetensors`` in ``folder``, each read while this process holds a shared lock
    on it, and the locks (keep them while the tensors serve). The file is read through the
    descriptor that holds the lock, and a file retired while this waited for the lock is
    refused, so no other version's bytes slip in. On a file system without ``flock`` the
    tensors are copied out of the file instead, and nothing is held."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors in {folder}")
    from safetensors.torch import load_file

    held, state = Held(), {}
    try:
        for path in files:
            f = open(path, "rb")  # noqa: SIM115 - kept open in `held`
            held.add(f)
            try:
                fcntl.flock(f, fcntl.LOCK_SH)
                locked = True
            except OSError:  # ENOLCK, EOPNOTSUPP: unlockable, so never mapped while it serves
                locked = False
            if locked and not _same_file(f, path):
                raise WeightLoadError(f"{path} was replaced while waiting to read it; "
                                      "load the current version")
            tensors = load_file(_through(f, path), device=str(device))
            state.update(tensors if locked else {k: v.clone() for k, v in tensors.items()})
    except BaseException:
        held.release()
        raise
    return state, held


def _same_file(f: IO[bytes], path: Path) -> bool:
    try:
        now = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(f.fileno())
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _through(f: IO[bytes], path: Path) -> str:
    """A name that opens the very file ``f`` is (Linux), else its path."""
    fd_link = f"/proc/self/fd/{f.fileno()}"
    return fd_link if os.path.exists(fd_link) else str(path)


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
    reused = spare is not None and overwrite(Path(spare) / FILE, state, dtype)
    if reused:
        try:
            Path(spare).rename(tmp)
        except OSError:  # e.g. a file system that keeps a removed open file as .nfsXXXX
            reused = False
    if not reused:
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
    file untouched, where it is missing, held by a reader, on a file system without ``flock``,
    or not laid out for exactly these names, dtypes and shapes (back to back, aligned, nothing
    else in the file)."""
    try:
        f = open(path, "r+b")  # noqa: SIM115 - closed below
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (EWOULDBLOCK), or no flock here: never write under a reader
            return False
        layout = _layout(f, state, dtype)
        if layout is None:
            return False
        with mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size) as mm:
            data = torch.frombuffer(mm, dtype=torch.uint8)
            try:
                for name, (start, end, kind) in layout.items():
                    data[start:end].view(kind).view(state[name].shape).copy_(state[name])
            except RuntimeError:  # left half written: it is only the spare, a new file follows
                return False
            finally:
                del data  # the map cannot close while a tensor still points into it
    return True


def _layout(f: IO[bytes], state: dict[str, torch.Tensor],
            dtype: torch.dtype | None) -> dict[str, tuple[int, int, torch.dtype]] | None:
    """Each tensor's byte range in the file and its dtype, when the file's header describes
    exactly ``state`` (cast to ``dtype``), the tensors back to back from the header's end to the
    file's, each aligned to its element size (safetensors' own rules); otherwise None."""
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
        if end - start != want.numel() * kind.itemsize or start % kind.itemsize:
            return None
        layout[name] = (start, end, kind)
    # Back to back and whole: no overlap (one tensor's bytes written under another's name)
    edge = 8 + n
    for start, end, _ in sorted(layout.values()):
        if start != edge:
            return None
        edge = end
    return layout if edge == size else None
