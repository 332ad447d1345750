"""How much of a GPU the trainer needs, and so what a rollout server sharing it may take.

SGLang takes ``--mem-fraction-static`` of its GPU up front for the weights and the KV cache
pool. On a GPU it shares with a trainer rank (one GPU, or more servers than a machine can give
GPUs of their own) that fraction must leave the trainer its states and activations, or the
trainer runs out of memory at its first step. The rule, one place (docs/clusters.md, "Sizing"):

- the trainer's states, bytes per parameter: weights, gradients, Adam's two moments, in fp32
  (4 + 4 + 8 = 16; a bf16 run keeps fp32 master weights and computes under autocast); an fp16 run
  keeps half weights and gradients plus fp32 masters (2 + 2 + 4 + 8). ZeRO 1 shards the optimizer
  part over the ranks, ZeRO 2 the gradients too, ZeRO 3 the weights too;
- activations of one micro-batch (``trainer.micro_batch_tokens``): about 34 bytes per token per
  hidden unit per layer at 2-byte precision (Korthikanti et al. 2022, without the attention
  scores, which a fused attention kernel does not keep), twice that in fp32; with activation
  checkpointing, each layer's input (2 bytes per token per hidden unit) plus one layer in full;
- the logits of a chunk of the micro-batch in fp32, and a reserve for the CUDA context, NCCL's
  buffers and the allocator's slack (:data:`RESERVE_BYTES` per process).

An estimate, not a measurement: ``rollout.mem_fraction`` overrides the computed fraction.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from training_core.dtypes import PRECISIONS, precision

GIB = 1 << 30
RESERVE_BYTES = 2 * GIB  # CUDA context, NCCL buffers, allocator slack: per process on the GPU
MAX_SHARED_FRACTION = 0.85  # what a sharing server may take at most, whatever the trainer needs
SERVER_WEIGHT_HEADROOM = 1.25  # a server needs its weights and some KV cache at least
LOGIT_CHUNK_TOKENS = 1024  # tokens whose fp32 logits exist at once when logprobs are chunked
_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                  "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class GpuMemoryError(ValueError):
    """The plan does not fit the GPU; the message names the numbers and the fields to change."""


@dataclass(frozen=True)
class ModelSize:
    params: int
    hidden: int
    layers: int
    vocab: int


def model_size(model_dir: str | Path) -> ModelSize:
    """Parameter count from the safetensors headers (no weight is read), shape from config.json."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    params = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            params += count
    if params == 0:
        raise ValueError(f"{model_dir}: no safetensors weights to size the model by")
    return ModelSize(params=params, hidden=int(config["hidden_size"]),
                     layers=int(config["num_hidden_layers"]), vocab=int(config["vocab_size"]))


def trainer_state_bytes(params: int, *, dtype: str, zero_stage: int, ranks: int) -> int:
    """Weights, gradients and optimizer states of one trainer rank."""
    held = PRECISIONS[precision(dtype).trainer_weights].width  # bf16: fp32 masters
    # Adam's two moments in fp32, and fp32 master weights beside half-width ones (fp16 mode)
    weights, grads, optim = held, held, 8 + (4 if held < 4 else 0)
    shard = max(ranks, 1)
    per_param = (weights / (shard if zero_stage >= 3 else 1) + grads / (shard if zero_stage >= 2 else 1)
                 + optim / (shard if zero_stage >= 1 else 1))
    return int(params * per_param)


def activation_bytes(size: ModelSize, *, tokens: int, dtype: str, checkpointing: bool) -> int:
    """One micro-batch's activations and its logits chunk."""
    width = precision(dtype).width
    per_layer = 34 * tokens * size.hidden * width / 2  # 34 bytes per token per unit at 2 bytes
    if checkpointing:
        saved = 2 * tokens * size.hidden * width / 2 * size.layers
        layers = saved + per_layer
    else:
        layers = per_layer * size.layers
    logits = min(tokens, LOGIT_CHUNK_TOKENS) * size.vocab * 4 * 3  # logits, softmax, grad
    return int(layers + logits)


def trainer_need_bytes(size: ModelSize, *, dtype: str, zero_stage: int, ranks: int,
                       micro_batch_tokens: int, checkpointing: bool = False) -> int:
    return (trainer_state_bytes(size.params, dtype=dtype, zero_stage=zero_stage, ranks=ranks)
            + activation_bytes(size, tokens=micro_batch_tokens, dtype=dtype,
                               checkpointing=checkpointing)
            + RESERVE_BYTES)


def server_weight_bytes(size: ModelSize, *, dtype: str) -> int:
    return size.params * precision(dtype).width


def shared_fraction(*, gpu_bytes: int, trainer_bytes: int, server_bytes: int,
                    explicit: float | None = None, where: str = "the GPU") -> float:
    """The ``--mem-fraction-static`` of a rollout server sharing ``where`` with a trainer rank
    that needs ``trainer_bytes``: what the trainer leaves (less a reserve), at most
    :data:`MAX_SHARED_FRACTION`; ``explicit`` (``rollout.mem_fraction``) when given. Refused,
    naming the numbers, when the server would not hold its weights or the two exceed the GPU."""
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    left = gpu_bytes - trainer_bytes - RESERVE_BYTES
    fraction = explicit if explicit is not None else min(MAX_SHARED_FRACTION, left / gpu_bytes)
    need = server_bytes * SERVER_WEIGHT_HEADROOM
    if fraction * gpu_bytes < need or (explicit is None and left <= 0):
        raise GpuMemoryError(
            f"a rollout server shares {where} ({gib(gpu_bytes)}) with a trainer rank that needs "
            f"about {gib(trainer_bytes)}; the server would get {gib(max(fraction * gpu_bytes, 0))} "
            f"(rollout.mem_fraction {fraction:.2f}) but needs at least {gib(need)} for its weights "
            "and a KV cache: give the servers GPUs of their own (more GPUs or nodes), raise "
            "trainer.zero_stage, turn on trainer.activation_checkpointing, lower "
            "trainer.micro_batch_tokens, or set rollout.mem_fraction (docs/clusters.md, Sizing)")
    if explicit is not None and explicit * gpu_bytes + trainer_bytes > gpu_bytes:
        raise GpuMemoryError(
            f"rollout.mem_fraction {explicit:.2f} gives the rollout server "
            f"{gib(explicit * gpu_bytes)} of {where} ({gib(gpu_bytes)}), and the trainer rank "
            f"sharing it needs about {gib(trainer_bytes)}: together more than the GPU. Lower "
            f"rollout.mem_fraction to at most {max(left / gpu_bytes, 0):.2f}, or give the servers "
            "GPUs of their own (docs/clusters.md, Sizing)")
    return round(fraction, 3)
