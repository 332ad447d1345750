from django.conf import settings
from django.db import models

from webapp.accounts.models import Project


class Sweep(models.Model):
    """A group of runs that differ in one or two spec fields (the axes), launched together and
    shown together. Each run keeps its own values of the axes (``Run.sweep_values``)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="sweeps")
    name = models.CharField(max_length=100)
    base_spec = models.JSONField(help_text="the spec every run starts from (the user's overrides)")
    axes = models.JSONField(help_text='[{"field": "rollout.max_staleness", "values": [0, 1, 2]}]')
    share_warm_start = models.BooleanField(
        default=True, help_text="runs whose warm-start inputs agree make one warm start together")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name

    @property
    def fields(self) -> list[str]:
        return [axis["field"] for axis in self.axes]
