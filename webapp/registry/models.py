"""The model registry: runs' policy versions exported as Hugging Face folders, with their
lineage, and the aliases users move over them (``production``, ``best``, ...)."""

from django.conf import settings
from django.db import models
from django.db.models import Q

from training_core.metric_names import EVAL_ACCURACY
from webapp.accounts.models import Project
from webapp.datasets.models import DatasetVersion
from webapp.rewards.models import RewardFunctionVersion
from webapp.runs.models import Run


class ModelVersion(models.Model):
    """One exported version of a run. The worker fills in what the export resolved (version,
    step, evaluation, lineage) and where the folder lies in the store."""

    class Status(models.TextChoices):
        PENDING = "pending"
        READY = "ready"
        FAILED = "failed"

    # The project is the run's, kept here so permissions read as they do for runs.
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="model_versions")
    name = models.CharField(max_length=100, db_index=True, help_text="the registered model's name "
                                                                     "(default: the run's)")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="model_versions")
    requested = models.CharField(max_length=20, help_text="what was asked: a version, latest, best")
    version = models.BigIntegerField(null=True, blank=True, help_text="the policy version exported")
    step = models.BigIntegerField(null=True, blank=True, help_text="the step that produced it")
    dataset_version = models.ForeignKey(DatasetVersion, on_delete=models.PROTECT, related_name="+")
    reward_version = models.ForeignKey(RewardFunctionVersion, on_delete=models.PROTECT,
                                       related_name="+")
    evaluation = models.JSONField(default=dict, help_text="held-out metrics recorded at the version")
    lineage = models.JSONField(default=dict, help_text="the export's oolong.json (spec included)")
    source = models.CharField(max_length=20, blank=True, help_text="pushed | checkpoint | initial")
    path = models.CharField(max_length=500, blank=True, help_text="the folder in the store")
    size_bytes = models.BigIntegerField(default=0)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING,
                              db_index=True)
    error = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(
            fields=["run", "version"], condition=Q(status="ready"), name="model_version_once")]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    @property
    def eval_accuracy(self) -> float | None:
        return self.evaluation.get(EVAL_ACCURACY)


class ModelAlias(models.Model):
    """A name in a project that points at one model version; moving it is an update."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="model_aliases")
    name = models.CharField(max_length=50)
    model_version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="aliases")
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="model_alias_unique")]
