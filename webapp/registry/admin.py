from django.contrib import admin

from webapp.registry.models import ModelAlias, ModelVersion


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "run", "version", "step", "status", "created_at")
    list_filter = ("status", "project")


@admin.register(ModelAlias)
class ModelAliasAdmin(admin.ModelAdmin):
    list_display = ("name", "project", "model_version", "updated_at")
