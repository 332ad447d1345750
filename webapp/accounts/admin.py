from django.contrib import admin

from webapp.accounts.models import Membership, Project

admin.site.register(Project)
admin.site.register(Membership)
