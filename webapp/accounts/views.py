"""The login page, throttled on failed attempts (as is the API token endpoint)."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse

from webapp.core.throttle import login_blocked, login_failed, retry_after_s


class LoginView(auth_views.LoginView):
    template_name = "dashboard/login.html"

    def post(self, request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if login_blocked(request):
            response = HttpResponse("Too many failed logins from this address; try again later.",
                                    status=429, content_type="text/plain")
            response["Retry-After"] = str(retry_after_s())
            return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form) -> HttpResponse:
        login_failed(self.request)
        return super().form_invalid(form)
