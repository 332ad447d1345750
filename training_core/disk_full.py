"""Name a full disk where a run fails on one (issue 47: a disk-full failure never said the disk
was full: torch's checkpoint writer says "file write failed", safetensors an ``IoError``).

:func:`failure_reason` is the text a failed run reports (its ``failed`` event and status): the
exception as before, led by ``disk full: ...`` when the exception says so (ENOSPC or EDQUOT
anywhere in its chain, or in its text) or when the run directory's filesystem is out of space.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "StorageFull")
NEARLY_FULL_BYTES = 16 * 2**20  # less than this left: a write failure is a full disk


def _says_full(exc: BaseException | None) -> bool:
    for _ in range(16):  # the chain of causes and contexts, bounded
        if exc is None:
            return False
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        if any(text in str(exc) for text in FULL_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (None: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def failure_reason(exc: BaseException, run_dir: str | Path | None = None) -> str:
    """``Type: message``, led by the full disk's name and free space when that is the cause."""
    text = f"{type(exc).__name__}: {exc}"
    free = free_bytes(run_dir) if run_dir is not None else None
    # A failed write on a disk with (almost) nothing left: torch says only "file write failed".
    if _says_full(exc) or (free is not None and free < NEARLY_FULL_BYTES
                           and "write" in text.lower()):
        where = f" of the run directory {run_dir}" if run_dir is not None else ""
        left = f" ({free / 2**20:.1f} MB left)" if free is not None else ""
        return (f"disk full: no space left on the disk{where}{left}; free space there (or move "
                f"run_dir) and resume the run. {text}")
    return text
