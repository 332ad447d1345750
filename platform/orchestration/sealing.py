"""Secrets a flow hands to processes through Prefect, sealed so that only their addressee opens
them.

Prefect's API shows every flow run's parameters to every client holding its credential, and the
nodes of every run hold it (their workers poll the API). A run's credential in a parameter would
be any node's to read. So the flow seals what a process needs (the run id, the web app's URL and
the run's credential) with a key only that process's machines have, and passes the sealed text:

- the nodes' key, ``OOLONG_NODE_KEY``: one per run on Terraform nodes (the provider makes it and
  cloud-init writes it into the node's root-only environment file); the deployment's own for
  static nodes (set on the flows' worker and on every static node);
- the control plane's key, ``OOLONG_CONTROL_KEY``: the web app's workers seal the training-run
  flow's own token with it; only the flows' worker on the control plane has it.

AES-256-GCM with a random nonce; the purpose is authenticated data, so a node's sealed credential
never opens as the control plane's (or the reverse), and the run id is checked against the flow
run's own. The web app's URL travels inside the seal, not beside it: a forged flow run naming
another URL cannot make a node send a run's credential there.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from dataclasses import dataclass

NODE_KEY_ENV = "OOLONG_NODE_KEY"
CONTROL_KEY_ENV = "OOLONG_CONTROL_KEY"
_PREFIX = "sealed-v1."


class SealError(ValueError):
    """A sealed value that does not open with this key (another run's, forged, or damaged), or a
    key that is missing or malformed; the message names which."""


def new_key() -> str:
    """32 random bytes, urlsafe base64 (what the Terraform variable ``node_key`` accepts)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


def _key_bytes(key: str, where: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(key.encode())
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 32:
        raise SealError(f"{where} is not a key (32 bytes in urlsafe base64; make one with "
                        "`python -m orchestration.sealing`)")
    return raw


def key_from_env(name: str) -> str:
    """The key in environment variable ``name``; raises naming it when it is unset or bad."""
    key = os.environ.get(name, "").strip()
    if not key:
        raise SealError(f"{name} is not set: " + (
            "every node needs its run's node key (cloud-init writes it on Terraform nodes; set "
            "the deployment's on the flows' worker and every static node)" if name == NODE_KEY_ENV
            else "the web app's workers and the flows' worker on the control plane need the same "
                 "control key"))
    _key_bytes(key, name)
    return key


def seal(key: str, payload: dict, *, purpose: str) -> str:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = secrets.token_bytes(12)
    data = AESGCM(_key_bytes(key, "the sealing key")).encrypt(
        nonce, json.dumps(payload, sort_keys=True).encode(), purpose.encode())
    return _PREFIX + base64.urlsafe_b64encode(nonce + data).decode()


def unseal(key: str, sealed: str, *, purpose: str) -> dict:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if not isinstance(sealed, str) or not sealed.startswith(_PREFIX):
        raise SealError("not a sealed value")
    try:
        raw = base64.urlsafe_b64decode(sealed[len(_PREFIX):].encode())
        data = AESGCM(_key_bytes(key, "the sealing key")).decrypt(raw[:12], raw[12:],
                                                                  purpose.encode())
    except (InvalidTag, ValueError) as exc:
        raise SealError(f"the sealed {purpose} credential does not open with this machine's key "
                        "(another run's, or altered)") from exc
    return json.loads(data)


@dataclass(frozen=True)
class RunCredential:
    """What a process of a run needs to reach the web app as that run."""

    run_id: int
    tracker_url: str
    token: str

    def seal(self, key: str, *, purpose: str) -> str:
        return seal(key, {"run_id": self.run_id, "tracker_url": self.tracker_url,
                          "token": self.token}, purpose=purpose)

    @classmethod
    def unseal(cls, key: str, sealed: str, *, purpose: str, run_id: int) -> RunCredential:
        """The credential in ``sealed``, for run ``run_id`` only (a flow run whose parameters
        pair one run's id with another's seal is refused)."""
        data = unseal(key, sealed, purpose=purpose)
        if data.get("run_id") != run_id:
            raise SealError(f"the sealed credential is run {data.get('run_id')}'s, not run "
                            f"{run_id}'s")
        return cls(run_id, str(data["tracker_url"]), str(data["token"]))

    def __repr__(self) -> str:  # never the token, in a log line or a traceback
        return f"RunCredential(run_id={self.run_id}, tracker_url={self.tracker_url!r})"


NODE = "node"  # purposes: what a node process opens
CONTROL = "control"  # what the training-run flow opens


if __name__ == "__main__":
    print(new_key())
