from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from webapp.accounts.views import LoginView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/login/", LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include("webapp.api.urls")),
    path("", include("webapp.dashboard.urls")),
]
