"""One agent episode as the gateway sees it: its segments of exact token ids and its limits.

A segment is one growing sequence: a prompt, the model's completion, the next messages, the next
completion, ... as long as each request extends the last prompt plus completion. A request that
does not (the agent rewrote or dropped history, changed its tools) starts a new segment rendered
in full (a fork). Each segment trains as one row: loss on the sampled tokens only.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from training_core.api import PROMPT_VERSION, GenerationResponse

NOT_A_TURN = -1


@dataclass(frozen=True)
class AgentLimits:
    """Per episode: completions (turns), tokens the model samples, wall time."""

    max_turns: int = 8
    max_tokens: int = 1024
    timeout_s: float = 120.0


@dataclass
class Segment:
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[int]  # the turn that sampled each token; NOT_A_TURN for prompt tokens
    # The temperature each token was sampled at; 0.0: the run's (rollout.agent.sampling: pass
    # lets an agent choose, and the trainer then uses the same one for that token).
    temperatures: list[float] = field(default_factory=list)

    @classmethod
    def from_prompt(cls, ids: list[int]) -> Segment:
        seg = cls([], [], [], [], [])
        seg.add_prompt(ids)
        return seg

    def add_prompt(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [PROMPT_VERSION] * len(ids)
        self.turns += [NOT_A_TURN] * len(ids)
        self.temperatures += [0.0] * len(ids)

    def add_output(self, resp: GenerationResponse, turn: int, *, trained: bool = True,
                   temperature: float = 0.0) -> None:
        """The turn's sampled tokens; ``trained`` False (a greedy turn) keeps them as context."""
        n = len(resp.output_ids)
        self.ids += resp.output_ids
        self.mask += [int(trained)] * n
        self.logprobs += list(resp.output_logprobs)
        self.versions += list(resp.output_versions) if trained else [PROMPT_VERSION] * n
        self.turns += [turn if trained else NOT_A_TURN] * n
        self.temperatures += [temperature] * n


class SessionFailed(RuntimeError):
    """The episode broke a limit or its generation failed; the message says which."""


@dataclass
class Session:
    id: str
    key: str
    limits: AgentLimits = AgentLimits()
    item: dict[str, Any] | None = None
    started: float = field(default_factory=time.monotonic)
    segments: list[Segment] = field(default_factory=list)
    history: list[dict[str, Any]] | None = None  # canonical messages of the last turn + its reply
    tools_key: str = ""
    last_output_id: int | None = None
    turns: int = 0
    sampled_tokens: int = 0
    interruptions: int = 0
    forks: int = 0
    tool_calls: int = 0
    tool_parse_failures: int = 0
    sampling_overrides: int = 0  # turns whose sampling fields the run overrode
    rejected: int = 0  # requests refused without ending the episode (context, bad prompt)
    failure: str | None = None
    fatal: BaseException | None = None  # the servers failed: the run must fail, not the episode
    log: list[dict[str, Any]] = field(default_factory=list)  # turn by turn, for the viewer
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Responses API: response id -> the conversation up to and including that response, for
    # previous_response_id (the last few only).
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    completion_ids: list[str] = field(default_factory=list)  # every id this session answered
    group: str = ""  # online mode: the group it belongs to
    last_active: float = field(default_factory=time.monotonic)

    @classmethod
    def new(cls, limits: AgentLimits = AgentLimits(), item: dict[str, Any] | None = None) -> Session:
        return cls(id=secrets.token_hex(8), key="sk-oolong-" + secrets.token_urlsafe(24),
                   limits=limits, item=item)

    def fail(self, reason: str) -> SessionFailed:
        if self.failure is None:
            self.failure = reason
        return SessionFailed(reason)

    def budget(self, requested: int | None, run_max: int) -> int:
        """Tokens this turn may sample: the run's budget, clamped by the request's ``max_tokens``
        and by what is left of the episode's token limit; raises when a limit is reached."""
        if self.failure is not None:
            raise SessionFailed(f"the episode already failed: {self.failure}")
        if self.turns >= self.limits.max_turns:
            raise self.fail(f"turn limit reached ({self.limits.max_turns} completions per episode, "
                            "rollout.agent.max_turns)")
        left = self.limits.max_tokens - self.sampled_tokens
        if left <= 0:
            raise self.fail(f"token limit reached ({self.limits.max_tokens} sampled tokens per "
                            "episode, rollout.agent.max_tokens)")
        return max(1, min(run_max, left, requested or run_max))

    def metrics(self) -> dict[str, float]:
        return {"agent/turns": self.turns, "agent/segments": len(self.segments),
                "agent/forks": self.forks, "agent/tool_calls": self.tool_calls,
                "agent/tool_parse_failures": self.tool_parse_failures,
                "agent/sampling_overrides": self.sampling_overrides,
                "agent/rejected_requests": self.rejected}
