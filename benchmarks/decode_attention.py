"""The engine's decode-attention kernel against torch's attention, on SmolLM2-135M's shape.

    python benchmarks/decode_attention.py [--quick] --out bench-results/decode_attention.json

One decode step's attention for every layer of the model: 64 rows (each with its own left
padding, as a batch of prompts of different lengths has), 9 query heads over 3 key-value heads
of 64 dims, ``--columns`` attended columns of a buffer 1.5x wider (the slot cache's room), a
separate cache per layer as in the engine, so each layer's keys and values come from memory,
not from a cache the previous call warmed.

- ``kernel``: ``torch.ops.oolong.decode_attention`` (kernels/decode_step.cpp): the rotary
  embedding, the cache write and the attention in one pass over the keys in blocks of 32
  columns;
- ``torch``: what the engine runs without the kernels: the rotary embedding in torch, the new
  column written with ``index_copy_``, ``scaled_dot_product_attention`` with the mask as a bias
  over the written width, grouped-query heads expanded by torch.

Both on ``--threads`` threads, alternating per round; medians. Also the key and value bytes one
step reads and the kernel's rate over them, against the rate of a large read on this machine.
Writes {"runs": [{"precision", "kernel_ms", "torch_ms", "speedup", "kv_mb", "kernel_gb_s",
"kernel_ms_rounds", "torch_ms_rounds"}, ...], "machine": {"read_gb_s", ...}, "config": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROWS, HEADS, KV_HEADS, DIM, LAYERS = 64, 9, 3, 64, 30  # SmolLM2-135M at batch 64
PRECISIONS = ("bfloat16", "float32")


class Step:
    """One decode step's inputs for every layer: the caches (keys in blocks of 32 columns for the
    kernel, as the slot cache holds them in kernel mode; keys as they are for torch), the mask
    and q/k/v."""

    def __init__(self, dtype: torch.dtype, columns: int, layers: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        width = -(-columns * 3 // 2 // 32) * 32  # whole blocks of 32 columns
        self.column = columns - 1  # this step's key and value are written here
        self.key_blocks = [torch.randn(ROWS, KV_HEADS, width // 32, DIM, 32, generator=g).to(dtype)
                           for _ in range(layers)]
        self.keys = [torch.randn(ROWS, KV_HEADS, width, DIM, generator=g).to(dtype) for _ in range(layers)]
        self.values = [torch.randn(ROWS, KV_HEADS, width, DIM, generator=g).to(dtype) for _ in range(layers)]
        valid = torch.zeros(ROWS, width, dtype=torch.bool)
        for r in range(ROWS):  # left padding from 0 to a quarter of the columns
            valid[r, (r * 7) % (columns // 4): columns] = True
        self.bias = torch.zeros(ROWS, width).masked_fill_(~valid, float("-inf"))
        qkv = torch.randn(ROWS, HEADS + 2 * KV_HEADS, DIM, generator=g).to(dtype)
        self.q, self.k_new, self.v_new = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
        angles = torch.rand(ROWS, DIM // 2, generator=g) * 6
        self.cos = torch.cat([angles.cos()] * 2, -1)
        self.sin = torch.cat([angles.sin()] * 2, -1)
        self.signed_sin = torch.cat([-angles.sin(), angles.sin()], -1)  # what the kernel takes
        self.attended = int(valid.sum())

    def kv_bytes(self) -> int:
        """Keys and values one step reads: each row's attended columns, every layer."""
        element = self.q.element_size()
        return 2 * self.attended * KV_HEADS * DIM * element * len(self.key_blocks)


def kernel_ms(step: Step) -> float:
    from training_core.rollout_server import cpu_kernels

    op = cpu_kernels.decode_attention(DIM, torch.device("cpu"))
    start = time.perf_counter()
    for key_blocks, values in zip(step.key_blocks, step.values, strict=True):
        op(step.q, step.k_new, step.v_new, step.cos, step.signed_sin, key_blocks, values, step.bias,
           step.column, DIM ** -0.5)
    return (time.perf_counter() - start) * 1e3


def torch_ms(step: Step) -> float:
    width = step.column + 1
    cos, sin = step.cos.to(step.q.dtype).unsqueeze(1), step.signed_sin.to(step.q.dtype).unsqueeze(1)
    bias = step.bias[:, :width].to(step.q.dtype).view(ROWS, 1, 1, width)
    at = torch.tensor([step.column])
    start = time.perf_counter()
    for keys, values in zip(step.keys, step.values, strict=True):
        q = step.q * cos + torch.roll(step.q, DIM // 2, dims=-1) * sin
        k = step.k_new * cos + torch.roll(step.k_new, DIM // 2, dims=-1) * sin
        keys.index_copy_(2, at, k.unsqueeze(2))
        values.index_copy_(2, at, step.v_new.unsqueeze(2))
        F.scaled_dot_product_attention(q.unsqueeze(2), keys[:, :, :width], values[:, :, :width],
                                       attn_mask=bias, scale=DIM ** -0.5, enable_gqa=True)
    return (time.perf_counter() - start) * 1e3


def read_gb_s(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """A large sum's read rate on the threads torch has: what streaming from memory gets here."""
    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def report(measured: dict[str, dict], config: dict, machine: dict) -> dict:
    """The JSON from the rounds: ``measured[precision]`` holds ``kernel`` and ``torch`` (ms per
    step, a list per round) and ``kv_bytes``. Medians, the speedup, the kernel's read rate."""
    runs = []
    for precision, m in measured.items():
        kernel, baseline = statistics.median(m["kernel"]), statistics.median(m["torch"])
        runs.append({"precision": precision, "kernel_ms": kernel, "torch_ms": baseline,
                     "speedup": baseline / kernel, "kv_mb": m["kv_bytes"] / 1e6,
                     "kernel_gb_s": m["kv_bytes"] / kernel / 1e6,
                     "kernel_ms_rounds": m["kernel"], "torch_ms_rounds": m["torch"]})
    return {"runs": runs, "machine": machine, "config": config}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds (< 1 min)")
    parser.add_argument("--out", default="bench-results/decode_attention.json")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--columns", type=int, default=128, help="the step's width: prompt and tokens so far")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 21)

    from training_core.rollout_server import cpu_kernels

    if cpu_kernels.decode_attention(DIM, torch.device("cpu")) is None:
        print("the engine's CPU kernels are unavailable here (no C++ toolchain, or OOLONG_CPU_KERNELS=0)",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    measured = {}
    for precision in args.precisions.split(","):
        step = Step(getattr(torch, precision), args.columns, LAYERS)
        kernel_ms(step), torch_ms(step)  # first touches, one-time set-up
        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        for _ in range(rounds):
            times["kernel"].append(kernel_ms(step))
            times["torch"].append(torch_ms(step))
        measured[precision] = {**times, "kv_bytes": step.kv_bytes()}
        print(f"{precision}: kernel {statistics.median(times['kernel']):.2f} ms, "
              f"torch {statistics.median(times['torch']):.2f} ms per step of {LAYERS} layers", flush=True)
    from training_core.rollout_server.cpu_kernels import cpu_info

    machine = {"threads": args.threads, "read_gb_s": read_gb_s(), "cpu_model": cpu_info()[0]}
    out = report(measured, {"rows": ROWS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
                            "layers": LAYERS, "columns": args.columns, "rounds": rounds}, machine)
    for run in out["runs"]:
        print(f"{run['precision']}: {run['speedup']:.2f}x torch, {run['kernel_gb_s']:.1f} GB/s of keys and "
              f"values (a large read: {machine['read_gb_s']:.1f} GB/s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
