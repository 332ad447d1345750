"""A folder as a tar stream, one bounded chunk at a time: a download of a model never holds
the model in memory (nor a temporary archive on disk)."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 20  # bytes read per file chunk
BLOCK = tarfile.BLOCKSIZE


def tar_stream(folder: Path, arcname: str) -> Iterator[bytes]:
    """``folder``'s regular files under ``arcname/``, in name order, as a POSIX (pax) tar.
    Links and special files are skipped: the archive holds only what export wrote."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        info = tarfile.TarInfo(f"{arcname}/{path.relative_to(folder).as_posix()}")
        stat = path.stat()
        info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        sent = 0
        with path.open("rb") as fh:
            while sent < info.size:
                chunk = fh.read(min(CHUNK, info.size - sent))
                if not chunk:
                    raise OSError(f"{path} shrank while it was being sent")
                sent += len(chunk)
                yield chunk
        if info.size % BLOCK:
            yield b"\0" * (BLOCK - info.size % BLOCK)
    yield b"\0" * (2 * BLOCK)  # the end-of-archive marker


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
