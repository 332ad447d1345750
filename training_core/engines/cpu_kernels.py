"""The embedded engine's own CPU kernels (``kernels/decode_step.cpp``), built for this machine on
first use: decode attention (with the rotary embedding and the cache write folded in) and RMSNorm.

Decode attention at a small batch is a poor fit for torch's CPU kernels: each (row, key head)
is a [group, D] x [D, L] product, tiny for oneDNN's batched matmul, and the keys and values
arrive cold from memory at every layer. SmolLM2 in bf16 at 64 rows and ~100 columns spent
17 ms of a 59 ms step in the two batched matmuls, softmax and mask around them (an AMX Xeon,
2 threads). ``decode_attention.cpp`` does one (row, key head) per task: each loaded vector of
keys or values serves every query head of the group, accumulators stay in registers, masked
columns left and right of a row are not read, scores stay in fp32 (torch's bf16 path rounds
them to bf16 before the softmax), and the step's key is written into the cache (stored
transposed, slot_cache.py) while its lines are being read anyway. RMSNorm was five to eight
operators of a few microseconds each, 61 times a step.

The build is torch's own (``torch.utils.cpp_extension``, ninja, the system's C++ compiler) with
``-march=native``, into ``$OOLONG_CACHE/kernels/<key>`` where the key covers the source, torch's
version and this CPU's feature flags: a cache copied to another machine is rebuilt, not run on
instructions it lacks. About 15 s once per machine; ``python -m training_core.engines.cpu_kernels``
builds ahead (scripts/test.sh does). Where it cannot be built (no compiler) or
``OOLONG_CPU_KERNELS=0``, :func:`decode_attention` is None and the engine keeps torch's path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("oolong.server")

CPU_KERNELS_ENV = "OOLONG_CPU_KERNELS"  # "0": torch's kernels only (to compare, or rule them out)
SOURCES = [Path(__file__).parent / "kernels" / "decode_step.cpp"]
HEAD_SIZES = (16, 32, 64, 128)  # what the attention kernel is compiled for
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def cpu_info() -> tuple[str, frozenset[str]]:
    """This CPU's model name and feature flags (``/proc/cpuinfo``; elsewhere "unknown" and
    none)."""
    model, flags = "unknown", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = frozenset(value.split())
                break
    except OSError:
        pass
    return model, flags


def _cpu_flags() -> str:
    """What the build's -march=native depends on: the CPU's flags (its architecture without)."""
    return " ".join(sorted(cpu_info()[1])) or os.uname().machine


CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]


def _compiler() -> str:
    """Which C++ compiler torch's builder will run, and its file's identity (a new compiler
    builds anew) without starting it."""
    path = shutil.which(os.environ.get("CXX", "c++")) or ""
    if not path:
        return "none"
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def build_dir() -> Path:
    """The build's folder: its key covers the sources, flags, compiler, torch and this CPU."""
    from training_core.models.smollm2 import cache_root

    key = hashlib.sha256()
    for src in SOURCES:
        key.update(src.read_bytes())
    for part in (" ".join(CFLAGS), _compiler(), torch.__version__, _cpu_flags()):
        key.update(part.encode() + b"\0")
    return cache_root() / "kernels" / key.hexdigest()[:16]


def load() -> bool:
    """Build (once per machine) and load the kernels into ``torch.ops.oolong``; False where they
    cannot be (logged once per process)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    if os.environ.get(CPU_KERNELS_ENV, "1") == "0":
        return False
    try:
        target = build_dir()  # reads the sources: a package installed without them has none
        built = target / "built"  # written after a whole build: a library being linked is not it
        if not built.exists():
            _build(target, built)
        torch.ops.load_library(str(target / "oolong_kernels.so"))
        return True
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's kernels serve
        log.warning("CPU kernels not available, torch's attention decodes: %s", exc)
        return False


def _build(target: Path, built: Path) -> None:
    """Build under an flock of our own: servers starting together build once, and a builder
    that dies releases it (torch's own lock file is left behind by a killed build, and every
    later build then waits on it forever, so it is removed here, where no one else builds)."""
    from torch.utils.cpp_extension import load as build

    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built.exists():  # another process built it while this one waited
            return
        (target / "lock").unlink(missing_ok=True)
        log.info("building the engine's CPU kernels in %s (once per machine)", target)
        build(name="oolong_kernels", sources=[str(s) for s in SOURCES], build_directory=str(target),
              extra_cflags=CFLAGS, is_python_module=False, verbose=False)
        built.touch()


def decode_attention(head_dim: int, device: torch.device) -> Callable[..., torch.Tensor] | None:
    """``op(q [B, H, D], k_new, v_new [B, KV, D], cos, sin [B, D] float32, keys_t [B, KV, D, C],
    values [B, KV, C, D], bias [B, C] float32 (0 or -inf), column, scale) -> [B, H, D]``: the
    rotary embedding of q and k_new (sin's first half negated), k_new and v_new written at
    ``column`` of the cache views, then attention; fp32 and bf16 on CPU. None where it does not
    serve (another device, head size, or no build)."""
    if device.type != "cpu" or head_dim not in HEAD_SIZES or not load():
        return None
    return torch.ops.oolong.decode_attention


def rms_norm(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """``op(hidden [B, N], weight [N], eps) -> [B, N]``, transformers' LlamaRMSNorm (the norm in
    fp32, rounded, then the weight's product) in one call; None where it does not serve."""
    if device.type != "cpu" or not load():
        return None
    return torch.ops.oolong.rms_norm


if __name__ == "__main__":  # build ahead: `python -m training_core.engines.cpu_kernels`
    # Fails (exit 1) when they cannot be built, so that a broken kernel fails the test suite
    # instead of being skipped; OOLONG_CPU_KERNELS=0 skips them on purpose.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ready = load()
    print(f"CPU kernels {'ready' if ready else 'NOT available'} in {build_dir()}")
    raise SystemExit(0 if ready or os.environ.get(CPU_KERNELS_ENV) == "0" else 1)
