"""The embedded engine's own CPU kernels (``kernels/*.cpp``), built for this machine on first use:
decode attention (with the rotary embedding and the cache write folded in), RMSNorm, sampling
(``decode_step.cpp``), the projections of a decode step: bf16 on CPUs with AMX
(``amx_linear.cpp``), else bf16 or fp32 on AVX-512 ones (``avx512_linear.cpp``), else on AVX2
ones (``avx2_linear.cpp``), and a step's layers in one call over them (``decode_layers.cpp``);
see fused_decode.py.

Decode attention at a small batch is a poor fit for torch's CPU kernels: each (row, key head)
is a [group, D] x [D, L] product, tiny for oneDNN's batched matmul, and the keys and values
arrive cold from memory at every layer. SmolLM2 in bf16 at 64 rows and ~100 columns spent
17 ms of a 59 ms step in the two batched matmuls, softmax and mask around them (an AMX Xeon,
2 threads). ``decode_attention.cpp`` does one (row, key head) per task: each loaded vector of
keys or values serves every query head of the group, accumulators stay in registers, only the
blocks of keys holding a row's attended columns are read (masked ones score their bias) and only
its attended values, scores stay in fp32 (torch's bf16 path rounds
them to bf16 before the softmax), and the step's key is written into the cache (stored
in blocks of 32 columns, slot_cache.py) while its lines are being read anyway. RMSNorm was five to eight
operators of a few microseconds each, 61 times a step. Sampling was five passes of torch over
[64, 49,152] logits (the tempered softmax in fp32, block sums, cumulative sums, a gather): 3.3-3.9
ms of a SmolLM2 bf16 step; one pass per row that stays in cache takes 0.7-1.0. Their vectors are
one register of the target wide (sixteen floats with AVX-512, eight with AVX2): sixteen on an
AVX2 CPU were compiled to memory operations, and its fp32 attention then ran at 0.6x torch's
(an AVX2 EPYC, benchmarks/decode_attention.py: 99-103 -> 26 ms; torch's 63-74).

The build is torch's own (``torch.utils.cpp_extension``, ninja, the system's C++ compiler) with
``-march=native``, into ``$OOLONG_CACHE/kernels/<key>`` where the key covers the source, torch's
version and this CPU's feature flags: a cache copied to another machine is rebuilt, not run on
instructions it lacks. About 15 s once per machine; ``python -m training_core.rollout_server.cpu_kernels``
builds ahead (scripts/test.sh does). Where it cannot be built (no compiler) or
``OOLONG_CPU_KERNELS=0``, :func:`decode_attention` is None and the engine keeps torch's path.

One switch, and torch's path is the reference. The kernels, oneDNN's prepacked weights
(packed_linear.py) and the fused decode step (fused_decode.py) are an optional accelerator for
CPUs: ``OOLONG_CPU_KERNELS=0`` (:func:`enabled`) turns all of them off, and the engine decodes
through transformers' forward with torch's operators, the path every accelerated one is tested
against (tests/training_core/rollout_server/test_kernel_paths.py: each projection kernel this machine has).
The finer switches (``OOLONG_AMX``, ``OOLONG_AVX512_LINEAR``, ``OOLONG_AVX2_LINEAR``,
``OOLONG_FUSED_DECODE``) only narrow what that one allows.

Choices made by timing are made once per machine and recorded (:func:`recorded`, a JSON file
beside the build): which projection kernel serves which batch sizes, and whether bf16 goes in
vdpbf16ps's pairs. Every server of the machine reads the first one's answer, so two servers of
a run never sum in different orders because they timed a noisy second differently.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from training_core.cache import cache_root

log = logging.getLogger("oolong.server")

CPU_KERNELS_ENV = "OOLONG_CPU_KERNELS"  # "0": torch's kernels only (to compare, or rule them out)
AMX_ENV = "OOLONG_AMX"  # "0": not the AMX kernel's projections
AVX512_LINEAR_ENV = "OOLONG_AVX512_LINEAR"  # "0": not the AVX-512 kernel's (both "0": oneDNN's)
AVX2_LINEAR_ENV = "OOLONG_AVX2_LINEAR"  # "0": not the AVX2 kernel's; "1": it at every batch
AMX_MIN_ROWS = 17  # see projections()
SOURCES = [Path(__file__).parent / "kernels" / name for name in ("decode_step.cpp", "amx_linear.cpp",
                                                                  "avx512_linear.cpp",
                                                                  "avx2_linear.cpp",
                                                                  "decode_layers.cpp")]
HEADERS = [Path(__file__).parent / "kernels" / "projection_epilogue.h"]  # in the build's key too
HEAD_SIZES = (16, 32, 64, 128)  # what the attention kernel is compiled for
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def cpu_fields() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` ("model name", "cpu family", "model",
    "flags", ...); empty where there is none."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():  # the end of the first processor's block
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_info() -> tuple[str, frozenset[str]]:
    """This CPU's model name and feature flags (``/proc/cpuinfo``; elsewhere "unknown" and
    none)."""
    fields = cpu_fields()
    return fields.get("model name", "unknown"), frozenset(fields.get("flags", "").split())


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
    key = hashlib.sha256()
    for src in SOURCES + HEADERS:
        key.update(src.read_bytes())
    for part in (" ".join(CFLAGS), _compiler(), torch.__version__, _cpu_flags()):
        key.update(part.encode() + b"\0")
    return cache_root() / "kernels" / key.hexdigest()[:16]


def enabled() -> bool:
    """The one switch: False with ``OOLONG_CPU_KERNELS=0``, and then no part of the CPU
    accelerator runs (no kernels, no prepacked weights, no fused decode step): torch's path."""
    return os.environ.get(CPU_KERNELS_ENV, "1") != "0"


def load() -> bool:
    """Build (once per machine) and load the kernels into ``torch.ops.oolong``; False where they
    cannot be (logged once per process)."""
    global _loaded
    if not enabled():  # read at every call: the switch holds even after a load
        return False
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    if not enabled():
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
    """``op(q [B, H, D], k_new, v_new [B, KV, D], cos, sin [B, D] float32, key_blocks [B, KV,
    C / 32, D, 32], values [B, KV, C, D], bias [B, C] float32 (0 or -inf), column, scale) ->
    [B, H, D]``: the rotary embedding of q and k_new (sin's first half negated), k_new and v_new
    written at ``column`` of the cache views, then attention; fp32 and bf16 on CPU. Keys come in
    blocks of 32 columns (slot_cache.KEY_BLOCK). None where it does not serve (another device,
    head size, or no build)."""
    if device.type != "cpu" or head_dim not in HEAD_SIZES or not load():
        return None
    return torch.ops.oolong.decode_attention


def rms_norm(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """``op(hidden [B, N], weight [N], eps) -> [B, N]``, transformers' LlamaRMSNorm (the norm in
    fp32, rounded, then the weight's product) in one call; None where it does not serve."""
    if device.type != "cpu" or not load():
        return None
    return torch.ops.oolong.rms_norm


def sample(device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """``op(logits [B, V] bf16 or fp32, temperature [B] float32, u [B] float64, block) ->
    (tokens [B] int64, logprobs [B] float32)``: generation_engine's untruncated draw (the tempered
    softmax, blocks of ``block`` tokens, float64 running sums; T <= 0 the first maximum with its
    logprob at T = 1) in one pass per row; None where it does not serve (another device, logits
    in another dtype such as float16)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not load():
        return None
    return torch.ops.oolong.sample


def decode_layers(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """``op(h [B, hidden], input_norms, post_norms, eps, qkv, o, gate_up, down (lists, a tensor per
    layer), linear, cos, sin, key_blocks, values, bias, column, scale, heads, kv_heads) -> h``:
    a decode step's layers in one call (kernels/decode_layers.cpp), the same operators in the
    same order as fused_decode's loop, on the projection kernel named by ``linear`` (a
    :class:`Projections`' ``op``); None where it does not serve."""
    if device.type != "cpu" or not load():
        return None
    return torch.ops.oolong.decode_layers


def amx_linear(device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """``op(x [M, K] bf16, packed, other [M, N] | None, epilogue) -> [M, N]`` on weights packed
    by ``torch.ops.oolong.amx_pack`` (kernels/amx_linear.cpp): epilogue "none", "add" (other
    added before the rounding) or "silu_mul" (gate and up interleaved in blocks of 16 rows ->
    [M, N / 2]). None where it does not serve: another device or dtype, a build whose compiler
    did not target AMX, a kernel that refuses this process the tile state, or OOLONG_AMX=0."""
    if device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get(AMX_ENV) == "0":
        return None
    if not load() or not torch.ops.oolong.amx_available():
        return None
    return torch.ops.oolong.amx_linear


def avx512_linear(device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """``op(x [M, K], packed, other [M, N] | None, epilogue) -> [M, N]``, bf16 or fp32, on
    weights packed by ``torch.ops.oolong.avx512_pack`` (kernels/avx512_linear.cpp): amx_linear's
    epilogues with fp32 multiply-adds (bf16 widened, or packed in pairs of k for vdpbf16ps). None
    where it does not serve: another device or dtype, a build whose compiler did not target
    AVX-512 with bf16 conversions, or OOLONG_AVX512_LINEAR=0."""
    if (device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32)
            or os.environ.get(AVX512_LINEAR_ENV) == "0"):
        return None
    if not load() or not torch.ops.oolong.avx512_linear_available():
        return None
    return torch.ops.oolong.avx512_linear


def avx2_linear(device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """``op(x [M, K], packed, other [M, N] | None, epilogue) -> [M, N]``, bf16 or fp32, on
    weights packed by ``torch.ops.oolong.avx512_pack`` without pairs (kernels/avx2_linear.cpp):
    the same epilogues in passes of six rows by sixteen columns. None where it does not serve:
    another device or dtype, a build whose compiler did not target AVX2 with FMA, or
    OOLONG_AVX2_LINEAR=0."""
    if (device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32)
            or os.environ.get(AVX2_LINEAR_ENV) == "0"):
        return None
    if not load() or not torch.ops.oolong.avx2_linear_available():
        return None
    return torch.ops.oolong.avx2_linear


CALIBRATION_ROWS = (1, 4, 16, 64)  # the batch sizes a measured kernel is timed at (measured())
WIN_MARGIN = 0.95  # a measured kernel serves a batch size where it took under 95% of oneDNN's time


def _bucket(rows: int) -> int:
    """The calibration row count that stands for a batch of ``rows``: the largest not above it."""
    return max(r for r in CALIBRATION_ROWS if r <= max(rows, 1))


def _ranges(won: set[int]) -> str:
    """The batch sizes the calibration buckets in ``won`` stand for, e.g. "1-3, 64+"."""
    bounds = [*CALIBRATION_ROWS[1:], None]
    spans = [f"{r}+" if nxt is None else f"{r}-{nxt - 1}" if nxt - 1 > r else f"{r}"
             for r, nxt in zip(CALIBRATION_ROWS, bounds, strict=True) if r in won]
    return ", ".join(spans)


@dataclass(frozen=True)
class Projections:
    """The kernel that computes a decode step's projections here (in the model's dtype):
    ``linear(x, pack(w), other, epilogue)`` for the batches it :meth:`serves`.

    ``measure``: whether it is only worth it where it outruns oneDNN on this CPU, so the caller
    times both on its own weights (:func:`measured`) before it decodes on it."""

    name: str  # "amx", "avx512" (bf16 widened, or fp32), "avx512-pairs" (bf16 by vdpbf16ps), "avx2"
    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    op: str  # linear's operator in torch.ops.oolong (what decode_layers calls), e.g. "amx_linear"
    min_rows: int = 1
    measure: bool = False
    won: frozenset[int] | None = None  # CALIBRATION_ROWS it was faster at; None: not measured

    def serves(self, rows: int) -> bool:
        return rows >= self.min_rows and (self.won is None or _bucket(rows) in self.won)

    def describe(self) -> str:
        """Which batches it serves, e.g. "avx512-pairs at 1-3, 64+ rows" (the server logs it)."""
        rows = f"{self.min_rows}+" if self.won is None else _ranges(self.won)
        return f"{self.name} at {rows} rows" + (" (to be measured)" if self.measure else "")


def projections(device: torch.device, dtype: torch.dtype) -> Projections | None:
    """For bf16, AMX's kernel where it serves (batches of AMX_MIN_ROWS rows or more: its passes
    of 32 rows would pad smaller ones, where oneDNN's AMX path was as fast); else, bf16 or fp32,
    the AVX-512 kernel; else the AVX2 one; else None: oneDNN's projections.

    The AVX-512 kernel takes bf16 widened to fp32 where vdpbf16ps issues at half an FMA's rate
    (a Xeon without AMX), else in vdpbf16ps's pairs of k (AMD's Zen 4: as fast as an FMA, twice
    the products). Its rank against oneDNN still depends on the CPU and the batch: on that Xeon
    it was faster at every batch (bf16 1.6x at 64 rows, fp32 1.15x); on the EPYC, widened, oneDNN's
    bf16 was 1.3-2x faster from 4 rows up. So it comes with ``measure`` set, unless
    OOLONG_AVX512_LINEAR=1 asks for it at every batch (OOLONG_AVX512_LINEAR=0: never). The AVX2
    kernel is for CPUs where the AVX-512 one is not built (no AVX-512 with bf16 conversions:
    AMD's Zen 2 and 3, Xeons before Cooper Lake; where it is built, switching it off leaves
    oneDNN's), measured likewise (OOLONG_AVX2_LINEAR=1: at every batch; 0: never)."""
    kernels = available_projections(device, dtype)
    if "avx2" in kernels and torch.ops.oolong.avx512_linear_available():
        del kernels["avx2"]  # where the AVX-512 kernel is built, switching it off leaves oneDNN's
    return next(iter(kernels.values()), None)


def available_projections(device: torch.device, dtype: torch.dtype) -> dict[str, Projections]:
    """Every projection kernel this machine (its CPU and the build's compiler) has for ``dtype``,
    by instruction set ("amx", "avx512", "avx2"), in the order :func:`projections` prefers them;
    the switches apply."""
    kernels: dict[str, Projections] = {}
    amx = amx_linear(device, dtype)
    if amx is not None:
        kernels["amx"] = Projections("amx", torch.ops.oolong.amx_pack, amx, "amx_linear",
                                     min_rows=AMX_MIN_ROWS)
    avx512 = avx512_linear(device, dtype)
    if avx512 is not None:
        pairs = dtype == torch.bfloat16 and recorded(
            "avx512_dot_pairs_faster", lambda: bool(torch.ops.oolong.avx512_dot_pairs_faster()))
        kernels["avx512"] = Projections(
            "avx512-pairs" if pairs else "avx512", partial(_avx512_pack, pairs=pairs), avx512,
            "avx512_linear", measure=os.environ.get(AVX512_LINEAR_ENV) != "1")
    avx2 = avx2_linear(device, dtype)
    if avx2 is not None:
        kernels["avx2"] = Projections("avx2", partial(_avx512_pack, pairs=False), avx2,
                                      "avx2_linear", measure=os.environ.get(AVX2_LINEAR_ENV) != "1")
    return kernels


def choices_file() -> Path:
    """Where this machine's timed choices are recorded: beside the build, whose key covers the
    sources, the compiler, torch and the CPU (another machine or build chooses anew)."""
    return build_dir().parent / f"{build_dir().name}-choices.json"


def recorded(key: str, choose: Callable[[], Any]) -> Any:
    """``choose()``'s answer for ``key`` as this machine first recorded it; the first caller
    runs it (under a lock, so servers starting together time once) and records it (JSON). A
    record that cannot be read or written is chosen anew, and logged."""
    path = choices_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            choices = json.loads(path.read_text()) if path.exists() else {}
            if key not in choices:
                choices[key] = choose()
                tmp = path.with_suffix(f".tmp-{os.getpid()}")
                tmp.write_text(json.dumps(choices, indent=1, sort_keys=True))
                tmp.replace(path)
                log.info("recorded this machine's choice %s = %s in %s", key, choices[key], path)
            return choices[key]
    except (OSError, ValueError) as exc:
        log.warning("choice %s not recorded (%s): chosen for this process only", key, exc)
        return choose()


def _avx512_pack(w: torch.Tensor, *, pairs: bool) -> torch.Tensor:
    """bf16 in vdpbf16ps's pairs of k where they are faster on this CPU (and K is even), else
    widened (kernels/avx512_linear.cpp); the kernel reads the layout from the packed shape."""
    return torch.ops.oolong.avx512_pack(w, pairs and w.shape[-1] % 2 == 0)


def measured(kernel: Projections, kernel_step: Callable[[int], None],
             onednn_step: Callable[[int], None], repeats: int = 2) -> Projections | None:
    """``kernel`` restricted to the CALIBRATION_ROWS batches where ``kernel_step(rows)`` ran
    faster than ``onednn_step(rows)`` by WIN_MARGIN (each the same projections of a step at that
    many rows; the best of ``repeats``, 8 where the untimed first pair took under 2 ms, taken in
    turns so that a burst of load hits both); None where it won at none, so the caller keeps no copy of weights
    for it. The margin: a near tie would be decided by noise, and the choice (it changes the
    order of the sums) would then differ between servers for nothing."""
    won = set()
    timings = []
    for rows in CALIBRATION_ROWS:
        best = {kernel_step: float("inf"), onednn_step: float("inf")}
        start = time.perf_counter()
        for run in (kernel_step, onednn_step):  # once each, untimed: first-touch and page faults
            run(rows)
        rounds = repeats if time.perf_counter() - start > 2e-3 else max(repeats, 8)
        for _ in range(rounds):
            for run in best:
                start = time.perf_counter()
                run(rows)
                best[run] = min(best[run], time.perf_counter() - start)
        if best[kernel_step] < WIN_MARGIN * best[onednn_step]:
            won.add(rows)
        timings.append(f"{rows}: {best[kernel_step] * 1e3:.2f}/{best[onednn_step] * 1e3:.2f}")
    log.info("%s projections measured against oneDNN's (rows: kernel/oneDNN ms) %s: %s",
             kernel.name, ", ".join(timings),
             f"the kernel serves batches of {_ranges(won)} rows" if won else "oneDNN's serve")
    return replace(kernel, measure=False, won=frozenset(won)) if won else None


def measured_once(kernel: Projections, model_key: str, kernel_step: Callable[[int], None],
                  onednn_step: Callable[[int], None]) -> Projections | None:
    """:func:`measured`, once per machine, kernel and model shape (``model_key``), recorded: the
    batch sizes it won, or none. Every later server of this machine decodes on the same choice."""
    won = recorded(f"projections:{kernel.name}:{model_key}", lambda: sorted(
        (chosen.won or ()) if (chosen := measured(kernel, kernel_step, onednn_step)) else ()))
    if not won:
        return None
    return replace(kernel, measure=False, won=frozenset(won))


if __name__ == "__main__":  # build ahead: `python -m training_core.rollout_server.cpu_kernels`
    # Fails (exit 1) when they cannot be built, so that a broken kernel fails the test suite
    # instead of being skipped; OOLONG_CPU_KERNELS=0 skips them on purpose.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ready = load()
    print(f"CPU kernels {'ready' if ready else 'NOT available'} in {build_dir()}")
    raise SystemExit(0 if ready or os.environ.get(CPU_KERNELS_ENV) == "0" else 1)
