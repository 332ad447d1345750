"""Contracts between the layers: plain dataclasses and Protocols, no logic.

Versions: the policy version ``v`` starts at 0 and grows by one per optimizer update pushed to
the rollout servers. Every generated token carries the version that produced it; prompt tokens
carry -1.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
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
    # Requests with one key go to one server while it is up (an agent session's turns: that
    # server's prefix cache holds the conversation so far). None: the least loaded server.
    route_key: str | None = None


@dataclass
class GenerationResponse:
    """One completed generation, possibly stitched from several interrupted server calls."""

    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # "stop" | "length" (an interrupted sample whose budget ran out: "length")
    interruptions: int = 0
    budget_clamped: bool = False  # max_new_tokens cut to what the servers' context left


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


# ---- the inference side's errors: what the loop, workflows and gateway may catch -------------

class RolloutServerError(RuntimeError):
    """The rollout servers failed (unreachable, 5xx past the retry window, a failed weight load)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class EpisodeError(RuntimeError):
    """One episode's request failed on its own account (the run goes on without it)."""


class RequestRejected(EpisodeError):
    """The server answered 4xx: the request is wrong, and sending it again cannot help."""


class GenerationAborted(EpisodeError):
    """The server aborted a request that no pause interrupted, or one was interrupted too often."""


class NonFiniteUpdate(RuntimeError):
    """An update was refused before its optimizer step: a non-finite advantage, loss or gradient
    (issue 47: a reward of 1e39 made every parameter NaN). Nothing was applied or pushed."""


@runtime_checkable
class InferenceEngine(Protocol):
    """The rollout side as workflows, evaluation and the loop see it: generation that survives
    weight updates (``transport.rollout_client.RolloutClient`` over SGLang-compatible servers).

    ``version`` is the policy version new tokens come from (its owner: training_core.version).
    ``pause`` interrupts generation for a weight update (in-flight requests come back and are
    continued after ``resume``)."""

    @property
    def version(self) -> int: ...

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse: ...

    async def agenerate_group(self, request: GenerationRequest, n: int) -> list[GenerationResponse]:
        """``n`` samples of one prompt (one batched request where the servers take it)."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def aclose(self) -> None:
        """Close the connections this event loop holds (one pool per loop)."""
        ...


class WeightReceiver(InferenceEngine, Protocol):
    """An inference engine whose servers take new weights: what ``weight_sync`` drives (SGLang's
    weight-update routes, docs/design.md §4)."""

    @property
    def urls(self) -> list[str]: ...

    @property
    def flush_cache(self) -> bool: ...

    async def update_weights_from_disk(self, path: str, version: int) -> None: ...

    async def load_lora_adapter(self, name: str, path: str, version: int) -> None: ...

    async def load_lora_adapter_from_tensors(self, name: str, config: dict[str, Any],
                                             version: int) -> None: ...

    async def unload_unused_adapters(self) -> list[str]: ...

    async def tp_sizes(self) -> list[int]: ...

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offsets: list[int], world_size: int,
                                        group_name: str, backend: str) -> None: ...

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              version: int | None, flush_cache: bool,
                                              load_format: str | None = None) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    def weight_update_session(self) -> AbstractAsyncContextManager[None]:
        """SGLang's begin/end_weight_update around a push (nothing where a release lacks them);
        the end always follows the begin."""
        ...

    async def weight_versions(self) -> list[str]: ...


class TrainEngine(Protocol):
    """The trainer as the loop, weight sync and checkpoints see it
    (``trainer.deepspeed_trainer.DeepSpeedTrainer``). The loss is injected: ``train_step`` takes
    a pure tensor function (algorithms/loss.py)."""

    zero_stage: int
    reference: Any  # the frozen reference policy for KL presets, else None

    def logprobs(self, batch: TrainBatch, model: Any = None) -> torch.Tensor:
        """Per-token logprobs of ``batch`` under the current policy (or ``model``)."""
        ...

    def train_step(self, batch: TrainBatch, prox_logp: torch.Tensor | None, loss_fn: Callable,
                   *, minibatches: int = 1, ref_logp: torch.Tensor | None = None,
                   compute_rows: list[int] | None = None,
                   before_micro_batch: Callable[[], None] | None = None) -> dict[str, float]:
        """One update over ``batch``; returns its statistics (loss, tokens, grad norm, ...)."""
        ...

    def weights(self, *, cast: bool = True) -> dict[str, torch.Tensor]:
        """The full weights, for a push (a collective under ZeRO-3)."""
        ...

    def adapter_weights(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """A LoRA run's adapter (tensors in peft's keys, its config), for a push over the
        weight group instead of :meth:`weights`; None for a full fine-tuning run."""
        ...

    def save_weights(self, path: str | Path, *, spare: str | Path | None = None) -> Path:
        """The weights as a folder the servers load; ``spare``: a retired folder to write over."""
        ...

    def save_checkpoint(self, ckpt_dir: str | Path, tag: str,
                        client_state: dict[str, Any]) -> Path: ...

    def load_checkpoint(self, ckpt_dir: str | Path, tag: str) -> dict[str, Any]: ...


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
    # The temperature each token was sampled at, where some differ from the run's (an agent's
    # own under rollout.agent.sampling: pass); 0 means the run's. None: all the run's.
    temperatures: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask.sum(-1).tolist()

    def select(self, idx: list[int]) -> TrainBatch:
        import torch

        length = max(self.lengths[i] for i in idx)
        t = torch.tensor(idx)
        return TrainBatch(*(x[t, :length] for x in (
            self.input_ids, self.attention_mask, self.loss_mask, self.behav_logp, self.versions,
            self.advantages)), temperatures=None if self.temperatures is None
            else self.temperatures[t, :length])


class MetricsSink(Protocol):
    """Where a run reports: metrics per step, events, sample trajectories for the viewer,
    checkpoints and its own status. Every sink implements all of it (a method that means nothing
    for a sink is a no-op there)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def event(self, kind: str, message: str, **data: Any) -> None: ...

    def trajectories(self, step: int, samples: list[dict[str, Any]]) -> None: ...

    def checkpoint(self, step: int, version: int, path: str) -> None: ...

    def status(self, status: str, reason: str = "") -> None: ...

    def undelivered(self) -> list[dict[str, Any]]:
        """Records written but not yet where they go (a remote tracker). A checkpoint carries
        them, so losing the node that held them loses nothing; [] for a sink that writes
        straight to its destination."""
        ...

    def redeliver(self, records: list[dict[str, Any]]) -> None:
        """Send again what a checkpoint carried (``undelivered`` of an earlier sink); delivery is
        idempotent, so records that did arrive change nothing."""
        ...

    def close(self) -> None: ...
