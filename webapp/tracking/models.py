from django.db import models

from webapp.runs.models import Run


class MetricPoint(models.Model):
    """One value of one metric at one step. (run, key, step) is unique: ingest is idempotent."""

    # No index of its own: the unique (run, key, step) index starts with it (one index less to
    # keep up at ingest, and the planner never picks the narrower one for a series).
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_points",
                            db_index=False)
    key = models.CharField(max_length=100)
    step = models.BigIntegerField()
    value = models.FloatField()
    wall_time = models.FloatField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key", "step"], name="metric_point_unique")]


# Steps per MetricRollup block at each level: each level's block holds 4 of the level below.
ROLLUP_LEVELS = (32, 128, 512, 2048, 8192)
ROLLUP_STEPS = ROLLUP_LEVELS[0]


class MetricRollup(models.Model):
    """One metric's aggregates over a block of consecutive steps: ``ROLLUP_LEVELS[level]`` steps,
    block = step // those steps. Level 0 is recomputed from MetricPoint by the ingest whenever a
    point of the block is new or changed, each level above from the one below. A chart reads
    the coarsest level finer than its buckets: a 100k-step run's series is a few hundred rows."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_rollups",
                            db_index=False)  # the unique index starts with it
    key = models.CharField(max_length=100)
    level = models.SmallIntegerField(default=0)
    block = models.BigIntegerField()
    n = models.IntegerField()
    total = models.FloatField()
    low = models.FloatField()
    high = models.FloatField()
    first_step = models.BigIntegerField()
    last_step = models.BigIntegerField()
    wall_time = models.FloatField(help_text="the latest point's")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key", "level", "block"],
                                               name="metric_rollup_level_unique")]


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


class RunIngestUsage(models.Model):
    """What a run has stored through the ingest API, against its bounds (settings.INGEST_MAX_*):
    counted as rows are inserted, so a retried batch that inserts nothing counts nothing."""

    run = models.OneToOneField(Run, on_delete=models.CASCADE, primary_key=True,
                               related_name="ingest_usage")
    trajectories = models.BigIntegerField(default=0)
    trajectory_bytes = models.BigIntegerField(default=0)
    events = models.BigIntegerField(default=0)
