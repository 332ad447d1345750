"""LoRA adapters on the trainer's side (issue 49): wrapping the model with ``peft``, the base
policy without a second copy, and the adapter-only export the rollout servers load.

Layout of an export (peft's, what SGLang's ``/load_lora_adapter`` and ``PeftModel.from_pretrained``
read): ``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight`` /
``lora_B.weight``, A: rank x in, B: out x rank) and ``adapter_config.json`` (r, lora_alpha,
target_modules, ...). Written whole or not at all (a ``.tmp`` folder, then a rename).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from training_core.config import LoraSpec

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def wrap(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """``model`` with a trainable LoRA adapter on ``spec.target_modules``; every base weight is
    frozen (``requires_grad`` False), so only the adapter reaches the optimizer."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    missing = [t for t in spec.target_modules if t.rsplit(".", 1)[-1] not in names]
    if missing:
        raise ValueError(f"model.lora.target_modules: {', '.join(missing)} not in this model; its "
                         f"linear layers are {', '.join(sorted(names))}")
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=list(spec.target_modules), bias="none",
                        task_type="CAUSAL_LM")
    # autocast_adapter_dtype: a bf16 base would otherwise get bf16 adapter weights; ours are fp32
    # master weights anyway (the trainer loads bf16 runs in fp32).
    return get_peft_model(model, config)


@dataclass
class BaseOnly:
    """The reference policy of a KL preset when an adapter trains: the same module with the
    adapter disabled (``peft_model.disable_adapter()``), so no second copy of the base exists.
    The trainer's ``logprobs`` recognises it."""

    peft_model: torch.nn.Module


def save(peft_model: torch.nn.Module, folder: str | Path, *,
         dtype: torch.dtype | None = None) -> Path:
    """The adapter alone, in peft's layout, as ``folder`` (whole or not at all); cast to the
    servers' ``dtype`` where given."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = get_peft_model_state_dict(peft_model)
    save_file({k: v.detach().to(dtype or v.dtype).cpu().contiguous() for k, v in state.items()},
              str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
    peft_model.peft_config["default"].save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def state(peft_model: torch.nn.Module, *,
          dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter as :func:`save` writes it, without a disk: its tensors (peft's keys, cast to
    ``dtype`` where given, on the device they train on) and its ``adapter_config.json`` as a
    dict (weight_sync distributed sends both)."""
    from peft import get_peft_model_state_dict

    tensors = {k: v.detach().to(dtype or v.dtype)
               for k, v in get_peft_model_state_dict(peft_model).items()}
    config = peft_model.peft_config["default"].to_dict()
    return tensors, json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(
        v, set) else str(v)))
