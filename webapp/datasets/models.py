from django.conf import settings
from django.db import models

from webapp.accounts.models import Project


class Dataset(models.Model):
    class Task(models.TextChoices):
        QA = "qa", "question / answer"
        GSM8K = "gsm8k", "GSM8K (answer ends with '#### N')"
        ARITHMETIC = "arithmetic", "arithmetic (numeric answer)"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=100)
    task = models.CharField(max_length=20, choices=Task.choices, default=Task.QA)
    description = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="dataset_name_per_project")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class DatasetVersion(models.Model):
    """Immutable: a new upload makes a new version; rows live in a JSONL file named by checksum."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    source = models.CharField(max_length=200, help_text="upload file name or builtin:<name>")
    file_format = models.CharField(max_length=10)
    checksum = models.CharField(max_length=64)
    rows_path = models.CharField(max_length=500)
    row_count = models.PositiveIntegerField()
    stats = models.JSONField(default=dict)
    preview = models.JSONField(default=list)
    is_eval_set = models.BooleanField(default=False, help_text=(
        "an eval set: runs of its project may attach it, and every question in it is removed "
        "from those runs' training pool (issue 48)"))
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["dataset", "version"], name="dataset_version_unique")]
        ordering = ["-version"]

    def __str__(self) -> str:
        return f"{self.dataset.name} v{self.version}"
