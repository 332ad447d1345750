"""When proximal logprobs are recomputed: the one rule the schema, the loop and the trainer
follow.

The proximal policy of the decoupled objective is the trainer's policy right before the update
(version ``version``). Its logprobs come from one of three places:

- the update's own forward, with one PPO minibatch: every forward of the first minibatch runs
  before its optimizer step, so the update's logprobs, detached, are the proximal ones exactly
  (no separate pass; TRL does the same for on-policy steps);
- a separate trainer forward over some rows, with more minibatches;
- the behaviour logprobs, for a row whose every generated token came from version ``version``
  itself (it was sampled from the proximal policy), up to the float difference between the
  server's and the trainer's forward: ~1e-6 for the embedded engine in fp32, far more for a
  bf16 or SGLang server. That is why ``trainer.recompute_proximal: auto`` resolves to ``stale``
  only for the former (:func:`resolve_mode`). ``never`` approximates proximal by behaviour for
  every row (w = 1).

Light on purpose (no torch at import): the schema (config.py) resolves ``auto`` with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from training_core.dtypes import precision

if TYPE_CHECKING:
    import torch

# trainer.recompute_proximal's values (the schema's type)
ProximalSetting = Literal["auto", "stale", "always", "never"]


def resolve_mode(setting: str, *, backend: str, dtype: str) -> str:
    """``trainer.recompute_proximal`` with ``auto`` resolved: behaviour logprobs stand in for
    the proximal ones (``stale``) only where they are exact, the embedded server in a dtype whose
    forward matches the trainer's (``dtypes.Precision.embedded_matches_trainer``)."""
    if setting != "auto":
        return setting
    exact = backend == "embedded" and precision(dtype).embedded_matches_trainer
    return "stale" if exact else "always"


def update_gives_proximal(minibatches: int) -> bool:
    """Whether the update's own forward gives the proximal logprobs exactly (one minibatch: no
    optimizer step runs before any of its forwards)."""
    return minibatches == 1


def proximal_rows(*, mode: str, decoupled: bool, minibatches: int, versions: torch.Tensor,
                  loss_mask: torch.Tensor, version: int, compute_rows: list[int] | None = None,
                  collective_forward: bool = False) -> list[int] | None:
    """The rows of a batch whose proximal logprobs need a separate trainer forward; the other
    rows' behaviour logprobs stand in for theirs. None: the update's own forward gives them all
    (no separate pass).

    ``mode``: the resolved ``trainer.recompute_proximal`` (:func:`resolve_mode`); a preset that
    is not decoupled has no proximal policy (``never``). ``stale`` picks the rows with a loss
    token from a version older than ``version``, among ``compute_rows`` (the rows the update
    computes; None: all). ``collective_forward``: a trainer forward is a collective (ZeRO-3 over
    several ranks), so every rank recomputes all of its rows (the same number of forwards)."""
    if not decoupled:
        mode = "never"
    if mode != "never" and update_gives_proximal(minibatches):
        return None
    if mode == "stale" and collective_forward:
        mode = "always"
    if mode == "never":
        return []
    if mode == "always":
        return list(range(versions.shape[0]))
    if mode != "stale":
        raise ValueError(f"trainer.recompute_proximal {mode!r} is not resolved: expected stale, "
                         "always or never (proximal.resolve_mode)")
    stale = ((versions < version) & loss_mask.bool()).any(dim=1)
    rows = stale.nonzero().flatten().tolist()
    if compute_rows is not None:
        rows = sorted(set(rows) & set(compute_rows))
    return rows
