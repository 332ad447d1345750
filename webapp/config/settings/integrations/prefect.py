"""How the web app starts training runs (see platform/orchestration)."""

import os

# Where flows and trainers reach the web app (status, metrics, spec) with a run's token.
OOLONG_PUBLIC_URL = os.environ.get("OOLONG_PUBLIC_URL", "http://127.0.0.1:8000")

# What a Prefect server deployment needs (OOLONG_PREFECT_MODE=server): the server's API requires
# authentication (PREFECT_SERVER_API_AUTH_STRING on the server; every node of every run is its
# client, and parameters are readable through it), so the web app's workers present the credential
# (PREFECT_API_AUTH_STRING), and seal each flow's token with the control plane's key
# (OOLONG_CONTROL_KEY, shared with the flows' worker only) instead of passing it as a parameter.
PREFECT_SERVER_ENV = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "OOLONG_CONTROL_KEY")


def prefect_server_missing(environ=os.environ) -> list[str]:
    """The variables a server-mode deployment lacks (none in local mode)."""
    if environ.get("OOLONG_PREFECT_MODE", "local") != "server":
        return []
    return [name for name in PREFECT_SERVER_ENV if not environ.get(name, "").strip()]
