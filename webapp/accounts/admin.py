from django.contrib import admin

from webapp.accounts.models import Membership, Project, ProjectQuota


class ProjectQuotaInline(admin.StackedInline):
    model = ProjectQuota
    can_delete = True
    extra = 0
    max_num = 1


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    inlines = [ProjectQuotaInline]
    list_display = ["name", "slug", "created_at"]


admin.site.register(Membership)
admin.site.register(ProjectQuota)
