"""Reward failures made visible: a failed reward scores 0, so a run whose rewards all fail would
otherwise look like a hard task and train on zeros.

Per step the loop reports ``reward/error_frac``; the first error of each kind (the exception
type, or the jail's failure: timeout, killed, ...) becomes one event; and when more than half of
a step's rewards fail for ``reward.max_failing_steps`` consecutive steps the run fails, naming
the first error. A value out of range (not a finite number within ``reward.max_abs``) is a broken
reward, not a hard task or a flaky call: when more than half of one step's rewards are out of
range the run fails at that step, naming the reward and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OUT_OF_RANGE = "RewardOutOfRange"  # rewards.pool names a value out of range with this kind


class RewardsFailing(RuntimeError):
    """The run's rewards keep failing; the message says how often and the first error."""


def error_kind(message: str) -> str:
    """The kind of a reward error: the text before the first ':' (``TypeError``, ``reward timed
    out after 10 s``...), at most 80 characters."""
    head = message.split(":", 1)[0].strip() or "error"
    return head[:80]


@dataclass
class RewardFailureWatch:
    """Fed each step's reward errors (one entry per sample, None where it scored)."""

    max_failing_steps: int
    seen: dict[str, str] = field(default_factory=dict)  # kind -> the first message of that kind
    failing_steps: int = 0
    last_frac: float = 0.0
    out_of_range: str | None = None  # this step's first value out of range, when most were

    def observe(self, errors: list[str | None]) -> tuple[float, list[tuple[str, str]]]:
        """The step's error fraction and the (kind, message) pairs seen for the first time
        (emit them, then call :meth:`check`)."""
        failed = [e for e in errors if e]
        frac = len(failed) / len(errors) if errors else 0.0
        new: list[tuple[str, str]] = []
        for message in failed:
            kind = error_kind(message)
            if kind not in self.seen:
                self.seen[kind] = message
                new.append((kind, message))
        self.failing_steps = self.failing_steps + 1 if frac > 0.5 else 0
        self.last_frac = frac
        wild = [e for e in failed if error_kind(e) == OUT_OF_RANGE]
        self.out_of_range = (f"{len(wild)} of {len(errors)} rewards out of range; first: {wild[0]}"
                             if errors and len(wild) / len(errors) > 0.5 else None)
        return frac, new

    def check(self) -> None:
        """Raises :class:`RewardsFailing` once the consecutive-failure bound is reached, or at
        once when most of the step's rewards were out of range."""
        if self.out_of_range is not None:
            raise RewardsFailing(f"the reward function returns values out of range: "
                                 f"{self.out_of_range[:500]}")
        if self.failing_steps >= self.max_failing_steps:
            frac = self.last_frac
            first = next(iter(self.seen.values()), "")
            raise RewardsFailing(
                f"rewards failed for more than half of the samples in {self.failing_steps} "
                f"consecutive steps ({frac:.0%} in the last; reward.max_failing_steps = "
                f"{self.max_failing_steps}); first error: {first[:500]}")
