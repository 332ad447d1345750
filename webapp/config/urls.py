from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, register_converter

from webapp.accounts.views import LoginView
from webapp.core.params import IdConverter

# <id:...>: an id that fits 64 bits (a longer number is a 404, not a database overflow).
register_converter(IdConverter, "id")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/login/", LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include("webapp.api.urls")),
    path("", include("webapp.dashboard.urls")),
]

handler404 = "webapp.api.errors.not_found"
handler500 = "webapp.api.errors.server_error"
