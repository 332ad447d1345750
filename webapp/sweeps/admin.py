from django.contrib import admin

from webapp.sweeps.models import Sweep


@admin.register(Sweep)
class SweepAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "project", "created_at")
