"""The run's dtype (``model.dtype``): the one table of what each allowed value means to the
schema, the model loaders, the launcher, the embedded server, SGLang and the trainer.

Light on purpose (no torch at import): the run spec's schema (``config.py``) and the web app
read the allowed values and the default from here; torch dtypes are looked up only when asked
for (:func:`torch_dtype`). A string such as ``"bfloat16"`` written anywhere else in
``training_core`` is a second copy of this rule (tests/training_core/test_dtypes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

# The schema's type (pydantic needs the values spelled out); PRECISIONS below must cover
# exactly these, checked at import.
DtypeName = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class Precision:
    name: str  # the spec's model.dtype, torch's name without "torch.", the embedded --dtype
    sglang: str  # SGLang's --dtype (its "auto" would serve an fp32 folder in fp16)
    width: int  # bytes per served weight, activation and cache element
    # The dtype the trainer holds its weights in: a bf16 run keeps fp32 master weights (bf16
    # weights would lose Adam's steps smaller than 2^-8 of a weight) and runs its matmuls in
    # ``autocast``; float16 keeps DeepSpeed's fp16 mode (half weights, loss scaling).
    trainer_weights: str
    autocast: str | None  # the dtype the trainer's matmuls run in under autocast, if any
    fp16_mode: bool  # DeepSpeed's "fp16" section (loss scaling)
    # The embedded server in this dtype computes the trainer's distribution to ~1e-6, so a
    # sample's behaviour logprobs may stand in for its proximal ones (proximal.py).
    embedded_matches_trainer: bool


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("float32", "float32", 4, "float32", None, False, True),
    Precision("bfloat16", "bfloat16", 2, "float32", "bfloat16", False, False),
    Precision("float16", "float16", 2, "float16", None, True, False),
)}
DEFAULT_DTYPE: DtypeName = "float32"

if set(PRECISIONS) != set(get_args(DtypeName)) or DEFAULT_DTYPE not in PRECISIONS:
    raise ImportError("training_core.dtypes: DtypeName and PRECISIONS disagree")


def precision(name: str) -> Precision:
    """The table's row for ``model.dtype`` ``name``; a clear error for any other value."""
    try:
        return PRECISIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"model.dtype {name!r} is not one of {', '.join(PRECISIONS)}") from None


def sglang_dtype(name: str) -> str:
    """SGLang's ``--dtype`` for the run's dtype."""
    return precision(name).sglang


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in torch's spelling, with or without ``torch.`` (the run's
    dtype, or a dtype a weight update names on the wire, as SGLang's protocol writes them)."""
    import torch

    found = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: expected a torch dtype name such as "
                         f"{', '.join(PRECISIONS)}")
    return found


def wire_name(dtype: torch.dtype) -> str:
    """A torch dtype as weight updates name it (SGLang's form: ``torch.`` dropped)."""
    return str(dtype).removeprefix("torch.")
