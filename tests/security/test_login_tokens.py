"""Issue 27, part 4: the login throttle counts per username and client address (a trusted proxy
names the client), so nobody locks out anyone else; user API tokens are digests with an expiry,
listed and revoked by their owner, and revoked by a password change."""

from __future__ import annotations

import datetime

import pytest
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from tests.webapp.conftest import alice, bob  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db
PASSWORD = "alice-pass-123"


@pytest.fixture(autouse=True)
def _fresh_counts(settings):
    settings.LOGIN_FAILURE_LIMIT = 3
    cache.clear()
    yield
    cache.clear()


def _token(client: APIClient, username: str = "alice", password: str = PASSWORD):
    return client.post("/api/auth/token/", {"username": username, "password": password},
                       format="json")


def test_failures_for_one_username_never_block_another(alice, bob):  # noqa: F811
    shared = APIClient(REMOTE_ADDR="10.1.0.1")  # one NAT address, two people
    for _ in range(5):
        _token(shared, "alice", "guess")
    assert _token(shared, "alice", "guess").status_code == 429
    assert _token(shared, "bob", "bob-pass-123").status_code == 200


def test_one_attacker_behind_a_trusted_proxy_locks_out_only_itself(alice, settings):  # noqa: F811
    settings.TRUSTED_PROXIES = ["10.9.0.0/24"]
    attacker = APIClient(REMOTE_ADDR="10.9.0.5", HTTP_X_FORWARDED_FOR="203.0.113.7")
    for _ in range(5):
        _token(attacker, "alice", "guess")
    assert _token(attacker, "alice", "guess").status_code == 429
    # Everyone else comes through the same proxy and is not affected.
    user = APIClient(REMOTE_ADDR="10.9.0.5", HTTP_X_FORWARDED_FOR="198.51.100.2")
    assert _token(user).status_code == 200
    page = Client(REMOTE_ADDR="10.9.0.5", HTTP_X_FORWARDED_FOR="198.51.100.2")
    assert page.post("/accounts/login/", {"username": "alice", "password": PASSWORD}).status_code == 302
    # A client-sent chain is read from the proxy's end: a forged first hop changes nothing.
    forged = APIClient(REMOTE_ADDR="10.9.0.5", HTTP_X_FORWARDED_FOR="198.51.100.2, 203.0.113.7")
    assert _token(forged, "alice", "guess").status_code == 429


def test_x_forwarded_for_from_an_untrusted_peer_is_ignored(alice, settings):  # noqa: F811
    settings.TRUSTED_PROXIES = ["10.9.0.0/24"]
    for i in range(5):  # a new forged address each time: still one client
        _token(APIClient(REMOTE_ADDR="192.0.2.9", HTTP_X_FORWARDED_FOR=f"1.2.3.{i}"), "alice", "x")
    assert _token(APIClient(REMOTE_ADDR="192.0.2.9", HTTP_X_FORWARDED_FOR="1.2.3.99"),
                  "alice", "x").status_code == 429


def test_a_success_clears_the_count(alice):  # noqa: F811
    client = APIClient(REMOTE_ADDR="10.1.0.2")
    for _ in range(2):
        _token(client, "alice", "typo")
    assert _token(client).status_code == 200
    for _ in range(2):  # two more typos: the earlier two no longer count
        assert _token(client, "alice", "typo").status_code == 400
    assert _token(client).status_code == 200


def test_tokens_are_digests_with_an_expiry(alice):  # noqa: F811
    from knox.models import AuthToken

    r = _token(APIClient())
    assert r.status_code == 200
    token = r.json()["token"]
    row = AuthToken.objects.get(user=alice)
    assert token not in (row.digest, row.token_key) and token.startswith(row.token_key)
    assert row.expiry is not None and row.expiry > row.created + datetime.timedelta(days=29)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/projects/").status_code == 200
    AuthToken.objects.filter(digest=row.digest).update(
        expiry=row.created - datetime.timedelta(seconds=1))
    assert client.get("/api/projects/").status_code == 401  # expired
    assert not AuthToken.objects.filter(digest=row.digest).exists()  # and gone


def test_owners_list_and_revoke_their_tokens(alice, bob):  # noqa: F811
    first, second = _token(APIClient()).json(), _token(APIClient()).json()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {first['token']}")
    listed = client.get("/api/auth/tokens/").json()
    assert [t["token_key"] for t in listed] == [second["token_key"], first["token_key"]]
    assert [t["current"] for t in listed] == [False, True]
    assert all(first["token"] not in str(t) for t in listed)
    # Another user can neither see nor revoke them.
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Token {_token(APIClient(), 'bob', 'bob-pass-123').json()['token']}")
    assert [t["token_key"] for t in other.get("/api/auth/tokens/").json()] != [second["token_key"]]
    assert other.delete(f"/api/auth/tokens/{second['token_key']}/").status_code == 404
    assert client.delete(f"/api/auth/tokens/{second['token_key']}/").status_code == 204
    revoked = APIClient()
    revoked.credentials(HTTP_AUTHORIZATION=f"Token {second['token']}")
    assert revoked.get("/api/projects/").status_code == 401
    assert client.delete(f"/api/auth/tokens/{first['token_key']}/").status_code == 204  # logout
    assert client.get("/api/projects/").status_code == 401


def test_a_password_change_revokes_every_token(alice):  # noqa: F811
    token = _token(APIClient()).json()["token"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/projects/").status_code == 200
    # A login (which saves last_login) revokes nothing.
    assert Client().post("/accounts/login/", {"username": "alice", "password": PASSWORD}).status_code == 302
    assert client.get("/api/projects/").status_code == 200
    alice.set_password("a-new-passphrase-42")
    alice.save()
    assert client.get("/api/projects/").status_code == 401


def test_a_token_that_is_not_utf8_is_a_401():
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token \xff\xfe")
    assert client.get("/api/projects/").status_code == 401


def test_tokens_per_user_are_bounded(alice, settings):  # noqa: F811
    from knox.models import AuthToken

    settings.API_TOKENS_PER_USER = 3
    tokens = [_token(APIClient()).json()["token"] for _ in range(5)]
    assert AuthToken.objects.filter(user=alice).count() == 3
    oldest, newest = APIClient(), APIClient()
    oldest.credentials(HTTP_AUTHORIZATION=f"Token {tokens[0]}")
    newest.credentials(HTTP_AUTHORIZATION=f"Token {tokens[-1]}")
    assert oldest.get("/api/projects/").status_code == 401
    assert newest.get("/api/projects/").status_code == 200
