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

import hashlib
import logging
import os
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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def build_dir() -> Path:
    from training_core.models.smollm2 import cache_root

    key = hashlib.sha256()
    for src in SOURCES:
        key.update(src.read_bytes())
    key.update(torch.__version__.encode())
    key.update(_cpu_flags().encode())
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
    target = build_dir()
    built = target / "built"  # written after a whole build: a library being linked is not it
    try:
        if built.exists():
            torch.ops.load_library(str(target / "oolong_kernels.so"))
            return True
        from torch.utils.cpp_extension import load as build

        target.mkdir(parents=True, exist_ok=True)
        log.info("building the engine's CPU kernels in %s (once per machine)", target)
        # torch's build holds a lock in the directory: servers starting together build once
        build(name="oolong_kernels", sources=[str(s) for s in SOURCES], build_directory=str(target),
              extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
              is_python_module=False, verbose=False)
        built.touch()
        return True
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's kernels serve
        log.warning("CPU kernels not available, torch's attention decodes: %s", exc)
        return False


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
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"CPU kernels {'ready' if load() else 'NOT available'} in {build_dir()}")
