import hashlib
import secrets

from django.conf import settings
from django.db import models

from webapp.accounts.models import Project
from webapp.datasets.models import DatasetVersion
from webapp.rewards.models import RewardFunctionVersion


def _new_token() -> str:  # referenced by migration 0001 (runs once had a plaintext token)
    return secrets.token_urlsafe(32)


class Run(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        PROVISIONING = "provisioning"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"

    TERMINAL = {Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}
    # Allowed lifecycle moves; anything else is a bug or a late, out-of-order report.
    TRANSITIONS = {
        Status.QUEUED: {Status.PROVISIONING, Status.RUNNING, Status.FAILED, Status.CANCELLED},
        Status.PROVISIONING: {Status.RUNNING, Status.FAILED, Status.CANCELLED},
        Status.RUNNING: {Status.SUCCEEDED, Status.FAILED, Status.CANCELLED},
    }

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=100)
    dataset_version = models.ForeignKey(DatasetVersion, on_delete=models.PROTECT, related_name="runs")
    reward_version = models.ForeignKey(RewardFunctionVersion, on_delete=models.PROTECT, related_name="runs")
    spec = models.JSONField(help_text="the resolved training_core run spec")
    gateway_key = models.CharField(max_length=64, blank=True, help_text=(
        "online mode (rollout.mode: online): the key external agents present to the run's "
        "gateway; shown to the project's members"))
    status = models.CharField(max_length=15, choices=Status.choices, default=Status.QUEUED, db_index=True)
    status_reason = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    # 1 for the first submission; each resume of a failed or cancelled run adds one.
    attempt = models.PositiveIntegerField(default=1)
    orchestrator_ref = models.CharField(max_length=100, blank=True, help_text="Prefect flow run id")
    # The submission outbox (issue 47): a queued run without an orchestrator reference is still
    # to be submitted; runs_reconcile sends it again until it is, or fails it after a few sends.
    submit_attempts = models.PositiveIntegerField(default=0, help_text=(
        "times the run's submission was put on the task queue (or tried to be)"))
    submit_sent_at = models.DateTimeField(null=True, blank=True, help_text="the last of them")
    submit_error = models.TextField(blank=True, help_text="why the last send or submission failed")
    # A run of a sweep (webapp.sweeps) and its values of the sweep's axes.
    sweep = models.ForeignKey("sweeps.Sweep", null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="runs")
    sweep_values = models.JSONField(default=dict, blank=True,
                                    help_text='{"rollout.max_staleness": 0}')
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def duration_s(self) -> float | None:
        if not self.started_at:
            return None
        from django.utils import timezone

        return ((self.finished_at or timezone.now()) - self.started_at).total_seconds()


MAX_EVAL_SETS = 8  # EvalSpec.sets' bound in training_core.config


class RunEvalSet(models.Model):
    """A dataset version marked as an eval set, attached to a run: evaluated at every eval and
    logged as ``eval/<name>/...``; the run's spec names it in ``eval.sets`` (set by run_create,
    never by the user: its source is a path on the trainer's node)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="eval_sets")
    dataset_version = models.ForeignKey(DatasetVersion, on_delete=models.PROTECT,
                                        related_name="eval_runs")
    name = models.CharField(max_length=40, help_text="eval/<name>/...: the dataset's name as a "
                                                     "slug, unique within the run")
    position = models.PositiveSmallIntegerField(default=0)

    class Meta:
        ordering = ["position"]
        constraints = [
            models.UniqueConstraint(fields=["run", "name"], name="run_eval_set_name"),
            models.UniqueConstraint(fields=["run", "dataset_version"], name="run_eval_set_version"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.dataset_version})"


class RunEvent(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    time = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=30)
    message = models.TextField()
    data = models.JSONField(default=dict)
    # Set by reporters that retry (trainer, flows): a repeated report is stored once.
    dedup_key = models.CharField(max_length=100, null=True, blank=True)

    class Meta:
        ordering = ["time", "id"]
        constraints = [models.UniqueConstraint(fields=["run", "dedup_key"], name="event_dedup")]


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RunToken(models.Model):
    """A run's ingest token, as its SHA-256 only: the plaintext is shown once when it is issued
    (to the run's creator, or handed to the run's flow). Tokens stop working when the run ends."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tokens")
    token_hash = models.CharField(max_length=64, unique=True)
    purpose = models.CharField(max_length=20, help_text="creator | orchestrator")
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
