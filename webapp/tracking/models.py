from django.db import models

from webapp.runs.models import Run


class MetricPoint(models.Model):
    """One value of one metric at one step. (run, key, step) is unique: ingest is idempotent."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_points")
    key = models.CharField(max_length=100)
    step = models.BigIntegerField()
    value = models.FloatField()
    wall_time = models.FloatField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key", "step"], name="metric_point_unique")]


class LatestMetric(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="latest_metrics")
    key = models.CharField(max_length=100)
    step = models.BigIntegerField()
    value = models.FloatField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key"], name="latest_metric_unique")]


class TrajectorySample(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="trajectories")
    step = models.BigIntegerField(db_index=True)
    index = models.PositiveIntegerField(default=0)
    prompt = models.TextField()
    completion = models.TextField()
    reward = models.FloatField()
    tokens = models.JSONField(default=list, help_text="output tokens as text pieces")
    token_versions = models.JSONField(default=list)
    info = models.JSONField(default=dict)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "step", "index"], name="trajectory_unique")]
        ordering = ["step", "index"]


class Checkpoint(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.BigIntegerField()
    version = models.BigIntegerField()
    path = models.CharField(max_length=500)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="checkpoint_unique")]
        ordering = ["step"]


class Artifact(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="artifacts")
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=50, default="file")
    uri = models.CharField(max_length=500)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="artifact_unique")]
