from django.contrib import admin

from webapp.datasets.models import Dataset, DatasetVersion

admin.site.register(Dataset)
admin.site.register(DatasetVersion)
