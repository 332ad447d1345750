"""User API tokens (``Authorization: Token <key>``): django-rest-knox's tokens, stored as SHA-512
digests with an expiry, listed and revoked by their owner, revoked on a password change
(webapp.accounts.signals). Run tokens for trainers are another scheme (webapp.runs.auth)."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from knox.auth import TokenAuthentication
from rest_framework import exceptions


class UserTokenAuthentication(TokenAuthentication):
    """knox's authentication, with a header that is not UTF-8 refused as a bad token (401)
    rather than a UnicodeDecodeError (500)."""

    def authenticate_credentials(self, token: bytes):
        try:
            token.decode("utf-8")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        return super().authenticate_credentials(token)


class UserTokenScheme(OpenApiAuthenticationExtension):
    target_class = "webapp.accounts.auth.UserTokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return build_bearer_security_scheme_object(header_name="Authorization",
                                                   token_prefix="Token")
