"""The run's rollout-server secret: where it travels and how a request carries it.

Every rollout server of a run, embedded or SGLang, requires it on every route but its health
probes (SGLang's ``--api-key`` with the same ``--admin-api-key``; the embedded server's bearer
check); the trainer's client sends it. It travels in the environment (never argv, readable in
/proc, and never a spec field, which the web app shows): the launcher generates it per run
(``launch.new_server_key``) and gives it to each process it starts; SGLang reads it from its
0600 ``--config`` file."""

from __future__ import annotations

import hashlib
import hmac
import os

SERVER_KEY_ENV = "OOLONG_SERVER_KEY"


def server_key() -> str | None:
    """This process's copy of the run's key, None where the servers require none."""
    return os.environ.get(SERVER_KEY_ENV) or None


def derive_server_key(run_credential: str) -> str:
    """The run's server key wherever the run's credential is (the flow that issued it, each node
    that opened it): derived alike everywhere, so no second secret travels (a Prefect flow
    parameter would show it), and revealing nothing of the credential (SGLang holds the key).
    HMAC-SHA256 with a label of its own, 64 hex digits."""
    if not run_credential:
        raise ValueError("derive_server_key needs the run's credential (empty)")
    return hmac.new(run_credential.encode(), b"oolong rollout-server key v1",
                    hashlib.sha256).hexdigest()
