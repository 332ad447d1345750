"""The login page, throttled on failed attempts per username and address (as is the API token
endpoint; see webapp.core.throttle)."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse

from webapp.core.throttle import login_blocked, login_failed, login_succeeded, retry_after_s


class LoginView(auth_views.LoginView):
    template_name = "dashboard/login.html"

    def _username(self) -> str:
        return str(self.request.POST.get("username", ""))[:300]

    def post(self, request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if login_blocked(request, self._username()):
            response = HttpResponse("Too many failed logins for this user from this address; "
                                    "try again later.", status=429, content_type="text/plain")
            response["Retry-After"] = str(retry_after_s())
            return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form) -> HttpResponse:
        login_failed(self.request, self._username())
        return super().form_invalid(form)

    def form_valid(self, form) -> HttpResponse:
        login_succeeded(self.request, self._username())
        return super().form_valid(form)
