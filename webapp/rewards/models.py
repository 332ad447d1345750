from django.conf import settings
from django.db import models

from webapp.accounts.models import Project


class RewardFunction(models.Model):
    class Kind(models.TextChoices):
        BUILTIN = "builtin"
        CODE = "code"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="reward_functions")
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    description = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="reward_name_per_project")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class RewardFunctionVersion(models.Model):
    """Immutable. User code is validated by a worker in a sandbox, never in the web process."""

    class Status(models.TextChoices):
        PENDING = "pending"
        VALID = "valid"
        INVALID = "invalid"

    reward_function = models.ForeignKey(RewardFunction, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    builtin_name = models.CharField(max_length=50, blank=True)
    source = models.TextField(blank=True)
    entrypoint = models.CharField(max_length=100, default="reward")
    checksum = models.CharField(max_length=64)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    validation_report = models.JSONField(default=dict)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["reward_function", "version"], name="reward_version_unique")]
        ordering = ["-version"]

    @property
    def fn_path(self) -> str:
        """What a run spec's reward.fn gets (user code is materialised as a module on the node)."""
        if self.builtin_name:
            return f"builtin:{self.builtin_name}"
        from training_core.rewards.registry import user_reward_fn_path

        return user_reward_fn_path(self.reward_function_id, self.version, self.entrypoint)
