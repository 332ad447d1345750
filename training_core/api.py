"""Contracts between the layers: plain dataclasses and Protocols, no logic.

Versions: the policy version ``v`` starts at 0 and grows by one per optimizer update pushed to
the rollout servers. Every generated token carries the version that produced it; prompt tokens
carry -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

PROMPT_VERSION = -1


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    greedy: bool = False
    ignore_eos: bool = False

    def to_sglang(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": 0.0 if self.greedy else self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }


@dataclass
class GenerationRequest:
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None


@dataclass
class GenerationResponse:
    """One completed generation, possibly stitched from several interrupted server calls."""

    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # "stop" | "length" (an interrupted sample whose budget ran out: "length")
    interruptions: int = 0
    latency_s: float = 0.0


@dataclass
class Trajectory:
    """One sample, ready for the trainer. All lists have the same length (prompt + output)."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the policy generated
    logprobs: list[float]  # behaviour logprobs; 0.0 where loss_mask is 0
    versions: list[int]  # producing version; PROMPT_VERSION where loss_mask is 0
    reward: float
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    # Set at consume time when the sample is too stale for the loss. ``loss_mask`` stays as
    # generated: the sample keeps its length, its reward in the group baseline and its tokens in
    # the staleness metrics; only the trainer's loss skips it.
    dropped: bool = False

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError("trajectory fields must all have the length of input_ids")

    @property
    def num_output_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        gen = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(gen) if gen else PROMPT_VERSION


@dataclass
class TrajectoryGroup:
    """The n samples of one prompt (the unit of admission control and of GRPO baselines)."""

    samples: list[Trajectory]
    prompt_index: int = -1
    accepted_at: float = 0.0
    started_version: int = -1  # the policy version when its episode started (the executor's)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@runtime_checkable
class InferenceEngine(Protocol):
    """What a workflow may call: generation that survives weight updates."""

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse: ...

    @property
    def version(self) -> int: ...


class Workflow(Protocol):
    """One episode as one coroutine. Return ``None`` to reject the sample."""

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any]
    ) -> TrajectoryGroup | None: ...


@dataclass
class TrainBatch:
    """What the trainer consumes: right-padded tensors, all [N, L], per-token arrays aligned with
    ``input_ids`` (built from trajectory groups by ``training_core.batching``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behav_logp: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask.sum(-1).tolist()

    def select(self, idx: list[int]) -> TrainBatch:
        import torch

        length = max(self.lengths[i] for i in idx)
        t = torch.tensor(idx)
        return TrainBatch(*(x[t, :length] for x in (
            self.input_ids, self.attention_mask, self.loss_mask, self.behav_logp, self.versions,
            self.advantages)))


class MetricsSink(Protocol):
    """Where a run reports: metrics per step, events, sample trajectories for the viewer,
    checkpoints and its own status. Every sink implements all of it (a method that means nothing
    for a sink is a no-op there)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def event(self, kind: str, message: str, **data: Any) -> None: ...

    def trajectories(self, step: int, samples: list[dict[str, Any]]) -> None: ...

    def checkpoint(self, step: int, version: int, path: str) -> None: ...

    def status(self, status: str, reason: str = "") -> None: ...

    def close(self) -> None: ...
