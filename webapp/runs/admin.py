from django.contrib import admin

from webapp.runs.models import Run, RunEvent


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "project", "status", "created_at")
    list_filter = ("status", "project")


admin.site.register(RunEvent)
