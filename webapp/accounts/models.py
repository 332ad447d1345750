from django.conf import settings
from django.db import models


class Project(models.Model):
    """Everything (datasets, rewards, runs) belongs to a project; users see only theirs."""

    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership",
                                     related_name="projects")

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner"
        MEMBER = "member"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    project = models.ForeignKey(Project, on_delete=models.CASCADE)
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "project"], name="one_membership")]


class ProjectQuota(models.Model):
    """What a project's members may ask of the machines, set by administrators (Django admin,
    Project page). An empty field takes the site default (``settings.PROJECT_QUOTA_DEFAULTS``,
    OOLONG_QUOTA_* variables); a project without a row has every default. Administrators
    (``is_staff``) are not bound by these."""

    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="quota")
    max_servers = models.PositiveIntegerField(null=True, blank=True,
                                              help_text="rollout.num_servers")
    max_reward_workers = models.PositiveIntegerField(null=True, blank=True,
                                                     help_text="reward.workers")
    max_concurrent = models.PositiveIntegerField(null=True, blank=True,
                                                 help_text="rollout.max_concurrent")
    max_new_tokens = models.PositiveIntegerField(null=True, blank=True,
                                                 help_text="rollout.max_new_tokens")
    max_steps = models.PositiveBigIntegerField(null=True, blank=True, help_text="trainer.steps")
    max_model_params = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="parameters of a tiny model built from model.hidden_size "
                                         "and model.num_layers")

    def __str__(self) -> str:
        return f"quota of {self.project}"
