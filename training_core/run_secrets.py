"""Secrets every process of a placed run derives from the run's credential, so they agree
without the secret travelling anywhere.

A placed run's flow hands each node process the run's credential, sealed with the run's node key
(platform/orchestration/sealing.py). Every node opens the same credential, so a secret derived
from it is the same on every node and on the flow's machine (which issued the credential), and
needs no channel of its own: not a Prefect parameter, not a variable, not a file on a shared disk.
Derived by HMAC-SHA256 with a label per use, a derived secret reveals nothing of the credential
(it may be shown to a process that must never read the run's spec, such as an SGLang server
through its ``--api-key``), and secrets for different uses are unrelated.
"""

from __future__ import annotations

import hashlib
import hmac

_SERVER_KEY_LABEL = b"oolong rollout-server key v1"


def server_key(run_credential: str) -> str:
    """The run's rollout-server secret (``OOLONG_SERVER_KEY``): every server of the run requires
    it, the trainer sends it. 64 hex digits."""
    if not run_credential:
        raise ValueError("server_key needs the run's credential (empty)")
    return hmac.new(run_credential.encode(), _SERVER_KEY_LABEL, hashlib.sha256).hexdigest()
