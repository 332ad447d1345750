"""LoRA adapters in the embedded engine (issue 49): a peft adapter folder read and merged into a
copy of the base weights.

Why merged per adapter, not applied per request: every engine path (packed oneDNN linears, the
fused decode, the prefix forest) runs plain weights, and an RL run serves one adapter at a time
(the client names the current one in every request). Merging is one ``B @ A`` per adapted layer
when an adapter loads, and decoding then costs what it costs without an adapter. The price: the
engine holds one merged copy of the adapted weights beside the base, and a request is answered
by the adapter loaded last whichever loaded adapter it names (server.py says so, and the tokens'
``weight_version`` tells which version made them). SGLang applies each request's own adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."  # peft's prefix on every adapter key


class AdapterError(ValueError):
    """An adapter folder that cannot be applied to this model (the reply says why)."""


def read_deltas(folder: str | Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{weight name: scale * B @ A}`` of the adapter in ``folder`` (peft's layout), checked
    against the model's ``weights`` (names and shapes), in each weight's dtype."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(folder / ADAPTER_FILE))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"lora_path: no peft adapter at {folder} ({ADAPTER_CONFIG} and "
                           f"{ADAPTER_FILE}): {exc}") from None
    return deltas(config, tensors, weights, where=str(folder))


def is_adapter(names: list[str]) -> bool:
    """Whether tensors announced under ``names`` are a peft adapter's (every one a ``lora_A`` or
    ``lora_B`` weight), not the model's own."""
    return bool(names) and all(".lora_A." in n or ".lora_B." in n for n in names)


def deltas(config: dict, tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], *,
           where: str = "the adapter") -> dict[str, torch.Tensor]:
    """``{weight name: scale * B @ A}`` of an adapter given as its ``adapter_config.json``
    (``config``) and its tensors (peft's keys), checked against the model's ``weights``."""
    for key, unsupported in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(key) == unsupported:
            raise AdapterError(f"lora_path: {key} adapters are not supported here")
    if config.get("bias", "none") != "none":
        raise AdapterError("lora_path: adapters with trained biases are not supported here")
    try:
        rank = int(config["r"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"{where}: its config has no rank (r)") from None
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    out: dict[str, torch.Tensor] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix(PREFIX).split(".lora_A.", 1)[0]
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        name = module + ".weight"
        if b is None or name not in weights:
            raise AdapterError(f"lora_path: {key} has no {'lora_B' if b is None else 'layer'} "
                               "to go with it in this model")
        base = weights[name]
        delta = (b.float() @ a.float().to(b.device)) * scale
        if delta.shape != base.shape:
            raise AdapterError(f"lora_path: {module} is {tuple(base.shape)} here, the adapter "
                               f"makes {tuple(delta.shape)}")
        out[name] = delta
    if not out:
        raise AdapterError(f"lora_path: {where} holds no lora_A/lora_B weights")
    return out


def merged(base: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New tensors ``base + delta`` (summed in fp32, stored in the base's dtype); the base is
    left as it is, for the next adapter."""
    return {k: (base[k].float() + d.to(base[k].device)).to(base[k].dtype) for k, d in deltas.items()}
