"""What a flow hands a process through Prefect opens only with the addressee's key, for its own
run and purpose; the token never shows in a repr."""

from __future__ import annotations

import pytest
from orchestration.sealing import (
    CONTROL,
    NODE,
    NODE_KEY_ENV,
    RunCredential,
    SealError,
    key_from_env,
    new_key,
    seal,
    unseal,
)

from training_core.transport.server_auth import derive_server_key as server_key


def test_a_sealed_credential_opens_only_with_its_key_run_and_purpose():
    key, other = new_key(), new_key()
    cred = RunCredential(7, "https://oolong.example", "t0ken-of-run-7")
    sealed = cred.seal(key, purpose=NODE)
    assert "t0ken-of-run-7" not in sealed and "oolong.example" not in sealed
    assert RunCredential.unseal(key, sealed, purpose=NODE, run_id=7) == cred
    with pytest.raises(SealError, match="does not open with this machine's key"):
        RunCredential.unseal(other, sealed, purpose=NODE, run_id=7)  # another run's node
    with pytest.raises(SealError, match="does not open"):
        RunCredential.unseal(key, sealed, purpose=CONTROL, run_id=7)  # not the flow's
    with pytest.raises(SealError, match="run 7's, not run 8's"):
        RunCredential.unseal(key, sealed, purpose=NODE, run_id=8)  # forged pairing
    tampered = sealed[:-6] + ("A" if sealed[-6] != "A" else "B") + sealed[-5:]
    with pytest.raises(SealError):
        unseal(key, tampered, purpose=NODE)
    assert "t0ken" not in repr(cred) and "t0ken" not in str(cred)


def test_two_seals_of_one_value_differ_and_keys_are_checked(monkeypatch):
    key = new_key()
    assert seal(key, {"a": 1}, purpose=NODE) != seal(key, {"a": 1}, purpose=NODE)
    monkeypatch.delenv(NODE_KEY_ENV, raising=False)
    with pytest.raises(SealError, match="OOLONG_NODE_KEY is not set"):
        key_from_env(NODE_KEY_ENV)
    monkeypatch.setenv(NODE_KEY_ENV, "short")
    with pytest.raises(SealError, match="OOLONG_NODE_KEY is not a key"):
        key_from_env(NODE_KEY_ENV)


def test_the_server_key_is_derived_alike_everywhere_and_reveals_nothing():
    a, b = server_key("credential-a"), server_key("credential-b")
    assert a == server_key("credential-a") and a != b and len(a) == 64
    assert "credential" not in a
    with pytest.raises(ValueError):
        server_key("")
