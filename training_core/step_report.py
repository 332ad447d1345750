"""What a run reports, in one place: the loop (train.py) calls one method per moment of a step
and never writes to the sink, the batch log or the progress bar itself.

Per step: :meth:`StepReport.batch_taken` (the batch log, failed episodes and reward errors as
events; the run fails when most rewards keep failing), then :meth:`StepReport.step_done` (the
step's metrics line, sample trajectories, the progress bar) and :meth:`StepReport.checkpointed`.
Around the steps: :meth:`started`, :meth:`evaluated` (step 0 and a final version the loop
evaluated after its last step), :meth:`finished` or :meth:`failed`, and :meth:`close`.
"""

from __future__ import annotations

import json
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from tqdm import tqdm

from training_core.api import MetricsSink
from training_core.config import RunSpec
from training_core.disk_full import failure_reason
from training_core.metrics import BATCH_LOG
from training_core.reward_failures import RewardFailureWatch
from training_core.rollout import Batch
from training_core.rollout_profile import RolloutProfile
from training_core.step_metrics import batch_metrics, sample_records, step_metrics

# Episode failures beyond this many per step are counted in rollout/episode_errors, not evented.
MAX_FAILURE_EVENTS = 5


class StepReport:
    def __init__(self, spec: RunSpec, sink: MetricsSink, run_dir: Path, tokenizer: Any,
                 profile: RolloutProfile, *, first_step: int, progress: bool):
        self.spec, self.sink, self.run_dir, self.tokenizer = spec, sink, run_dir, tokenizer
        self.profile = profile
        self.reward_watch = RewardFailureWatch(spec.reward.max_failing_steps)
        self.batch_log = (run_dir / BATCH_LOG).open("a", buffering=1)
        self.bar = tqdm(total=spec.trainer.steps, initial=first_step - 1, disable=not progress,
                        desc=spec.name, unit="step", dynamic_ncols=True)
        self._step_start = time.perf_counter()

    def started(self, version: int) -> None:
        self.sink.event("started", f"run {self.spec.name} at version {version}",
                        run_dir=str(self.run_dir))
        if self.spec.metrics.report_status:
            self.sink.status("running")
        self.profile.sample()  # starts the baseline measurement

    def evaluated(self, step: int, version: int, results: dict[str, float]) -> None:
        """An evaluation outside a step's line: before the first step, or of a final version."""
        self.sink.log(step, {**results, "version": version})

    def step_started(self) -> None:
        self._step_start = time.perf_counter()

    def batch_taken(self, step: int, version: int, batch: Batch, algo: Any) -> dict[str, float]:
        """Step 1's report; returns the batch's own metrics (the step's line starts with them)."""
        self.batch_log.write(json.dumps({"step": step, "version": version,
                                         "prompts": [g.prompt_index for g in batch.groups]}) + "\n")
        for failure in batch.episode_failures[:MAX_FAILURE_EVENTS]:
            self.sink.event("episode_failed", failure.message, step=step,
                            prompt_index=failure.prompt_index)
        # Failed rewards score 0: the first error of each kind is evented, and the run fails
        # when most rewards keep failing (it would only look like a hard task).
        _, new_kinds = self.reward_watch.observe(
            [s.info.get("reward_error") for g in batch.groups for s in g.samples])
        for kind, message in new_kinds:
            self.sink.event("reward_error", message[:2000], step=step, error_kind=kind)
        self.reward_watch.check()
        return batch_metrics(batch.groups, version, algo)

    def step_done(self, step: int, version: int, batch: Batch, stats: dict[str, float],
                  metrics: dict[str, float], running: int, timings: dict[str, float]) -> None:
        """Step 7's report: the step's metrics line (what the batch, the update, the timers and
        the rollout profile measured), four sample trajectories, the progress bar."""
        metrics.update(step_metrics(batch, stats, version=version, running=running,
                                    step_time=time.perf_counter() - self._step_start))
        self._step_start = time.perf_counter()
        metrics.update(timings)
        metrics.update(self.profile.sample())
        self.sink.log(step, metrics)
        self.sink.trajectories(step, sample_records(batch.groups, self.tokenizer, n=4,
                                                    extract=self.spec.reward.extract))
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", v=version,
                             stale=f"{metrics['staleness/mean']:.2f}",
                             tok_s=f"{metrics['tokens_per_s']:.0f}")

    def checkpointed(self, step: int, version: int, saved: Path | None) -> None:
        if saved is not None:
            self.sink.checkpoint(step, version, str(saved.resolve()))

    def finished(self, step: int, version: int) -> None:
        self.sink.event("finished", f"finished at step {step}, version {version}")
        if self.spec.metrics.report_status:
            self.sink.status("succeeded")

    def failed(self, exc: BaseException, step: int) -> None:
        reason = failure_reason(exc, self.run_dir)  # [issue 47] a full disk is named as such
        # Each report on its own: a sink that cannot write (a full disk) must neither keep the
        # status from going out nor replace the run's own error.
        with suppress(Exception):
            self.sink.event("failed", reason, step=step)
        if self.spec.metrics.report_status:
            with suppress(Exception):
                self.sink.status("failed", reason)

    def close(self) -> None:
        self.bar.close()
        self.batch_log.close()
