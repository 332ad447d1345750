"""Reward failures made visible: a failed reward scores 0, so a run whose rewards all fail would
otherwise look like a hard task and train on zeros.

Per step the loop reports ``reward/error_frac``; the first error of each kind (the exception
type, or the jail's failure: timeout, killed, ...) becomes one event; and when more than half of
a step's rewards fail for ``reward.max_failing_steps`` consecutive steps the run fails, naming
the first error.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        return frac, new

    def check(self) -> None:
        """Raises :class:`RewardsFailing` once the consecutive-failure bound is reached."""
        if self.failing_steps >= self.max_failing_steps:
            frac = self.last_frac
            first = next(iter(self.seen.values()), "")
            raise RewardsFailing(
                f"rewards failed for more than half of the samples in {self.failing_steps} "
                f"consecutive steps ({frac:.0%} in the last; reward.max_failing_steps = "
                f"{self.max_failing_steps}); first error: {first[:500]}")
