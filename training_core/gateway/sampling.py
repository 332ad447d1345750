"""The run's sampling policy for what agents send (``rollout.agent.sampling``).

The trainer's importance weights assume it knows the distribution each token was sampled from,
so an agent's ``temperature: 0`` cannot simply be obeyed. Per run, one of:

- ``override`` (default): the run's sampling is used whatever the agent sends; what it sent and
  was not used is reported in the response header ``X-Oolong-Sampling-Overridden`` (e.g.
  ``temperature=0``) and counted per step in ``agent/sampling_overrides``. Agents work unchanged.
- ``refuse``: a field that differs from the run's is a 400 naming it (``error.param``).
- ``pass``: the agent's ``temperature``, ``top_p`` and ``top_k`` are used, and the trainer
  computes that turn's logprobs at the same temperature (a per-token temperature in the batch).
  ``temperature: 0`` samples greedily; a greedy turn is context, not trained (its tokens leave
  the loss). Penalties and ``logit_bias`` change the distribution in ways the trainer does not
  reproduce: refused. ``seed`` is reported, not used.

``top_logprobs`` is never produced (reported or refused alike).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from training_core.api import SamplingParams
from training_core.gateway.requests import BadRequest

POLICIES = ("override", "refuse", "pass")
OVERRIDDEN_HEADER = "X-Oolong-Sampling-Overridden"


@dataclass
class Decision:
    sampling: SamplingParams
    overridden: list[str]  # "name=value" the run did not use
    trained: bool = True  # False: a greedy turn under ``pass`` (its tokens leave the loss)


def _same(value: Any, run: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value - run) <= 1e-6


def _number(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(name, f"{name} must be a number in [{low}, {high}]")
    return float(value)


def decide(policy: str, run: SamplingParams, sent: dict[str, Any]) -> Decision:
    """The sampling of one turn under ``policy`` given what the agent ``sent``."""
    run_values = {"temperature": run.temperature, "top_p": run.top_p, "top_k": run.top_k}

    def neutral(name: str, value: Any) -> bool:
        if name in run_values:
            return _same(value, run_values[name])
        if name in ("frequency_penalty", "presence_penalty", "top_logprobs"):
            return value == 0
        return name == "logit_bias" and not value

    differs = {k: v for k, v in sent.items() if v is not None and not neutral(k, v)}
    if policy == "refuse":
        for name in differs:
            raise BadRequest(name, f"{name} is fixed by the run (rollout.agent.sampling: refuse; "
                             f"the run samples with temperature {run.temperature}, top_p "
                             f"{run.top_p}): leave it out or send the run's value")
        return Decision(run, [])
    if policy == "override":
        return Decision(run, [f"{k}={v}" for k, v in differs.items()])
    # pass
    for name in ("frequency_penalty", "presence_penalty", "logit_bias"):
        if name in differs:
            raise BadRequest(name, f"{name} changes the sampled distribution in a way the trainer "
                             "cannot reproduce: leave it out (rollout.agent.sampling: pass)")
    sampling = run
    if "temperature" in differs:
        sampling = replace(sampling, temperature=_number("temperature", differs["temperature"],
                                                         0.0, 2.0))
    if "top_p" in differs:
        top_p = _number("top_p", differs["top_p"], 0.0, 1.0)
        if top_p <= 0:
            raise BadRequest("top_p", "top_p must be in (0, 1]")
        sampling = replace(sampling, top_p=top_p)
    if "top_k" in differs:
        top_k = differs["top_k"]
        if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
            raise BadRequest("top_k", "top_k must be -1 or a positive integer")
        sampling = replace(sampling, top_k=top_k)
    greedy = sampling.temperature == 0
    if greedy:
        sampling = replace(sampling, greedy=True, temperature=run.temperature)
    reported = [f"{k}={v}" for k, v in differs.items() if k in ("seed", "top_logprobs")]
    return Decision(sampling, reported, trained=not greedy)
